"""The journey's faults through the Hub, while training runs (``make journey JOURNEY_ARGS=--faults``).

Once the trainer has published its first version after the anchor, one fault at a time, each
after the replica has caught up with the trainer again:

- a 429 storm: every Hub request of every token answered 429 (``Retry-After: 3``) for 20 s;
- 503s: every Hub request answered 503 for 30 s;
- the rollout Space's token revoked for 20 s, then restored;
- the Hub process killed (SIGKILL) and restarted 5 s later on the same ports (its Spaces, other
  processes, keep running and are taken over).

For each: when it began (the trainer's version then, whether training was running), what the
user saw (the dashboard Space's state and message during the fault, read through its ``/status``
API, which is not the Hub), and the recovery time (fault over -> the replica serves the trainer's
newest version again, read from the replica's ``/health``). The trainer's version is the number
of lines of its ``steps.jsonl`` (one per step; version k after step k).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from tools.local_hub.process import HubProcess

CATCH_UP_TIMEOUT_S = 180.0


def held_version(url: str, token: str | None = None) -> int | None:
    """The version the rollout Space serves (its ``/health``, with ``token`` for a private
    Space), None when it does not answer."""
    import httpx

    headers = {"X-HF-Authorization": f"Bearer {token}"} if token else {}
    try:
        return httpx.get(f"{url}/health", headers=headers, timeout=3).json().get("held_version")
    except (httpx.HTTPError, ValueError):
        return None


class FaultPlan(threading.Thread):
    """Runs the faults above against ``hub`` while the trainer process ``train`` runs.

    Args:
        hub: the local Hub (its admin routes; it is killed and restarted).
        steps_log: the trainer's ``steps.jsonl``.
        rollout_url, dashboard_url: the Spaces' URLs as ``make spaces`` printed them.
        train: the trainer's ``subprocess.Popen``.
        token: a token that may read the (private) Spaces.
    """

    def __init__(
        self,
        hub: HubProcess,
        steps_log: Path,
        rollout_url: str,
        dashboard_url: str,
        train,
        token: str | None = None,
    ):
        super().__init__(name="journey-faults", daemon=True)
        self.hub, self.steps_log, self.train, self.token = hub, steps_log, train, token
        self.rollout_url, self.dashboard_url = rollout_url, dashboard_url
        self.rows: list[dict] = []
        self.error: BaseException | None = None

    def trainer_version(self) -> int:
        try:
            return sum(1 for _ in open(self.steps_log))
        except OSError:
            return 0

    def dashboard(self) -> str:
        """The dashboard's state and message now ("?" when it cannot be read)."""
        try:
            import gradio_client

            client = gradio_client.Client(self.dashboard_url, token=self.token, verbose=False)
            s = client.predict(api_name="/status")
            return f"{s['state']}: {s['message']}" if s.get("message") else s["state"]
        except Exception as e:  # noqa: BLE001 - what the user would see is the point
            return f"? ({type(e).__name__})"

    def wait_caught_up(self, timeout_s: float = CATCH_UP_TIMEOUT_S) -> float | None:
        """Seconds until the replica serves the trainer's newest version (None: not in time)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            held = held_version(self.rollout_url, self.token)
            if held is not None and held >= self.trainer_version():
                return time.monotonic() - start
            if self.train.poll() is not None and held is not None:
                return time.monotonic() - start if held >= self.trainer_version() else None
            time.sleep(0.5)
        return None

    def run(self) -> None:
        try:
            while self.trainer_version() < 1 and self.train.poll() is None:
                time.sleep(0.5)
            for name, begin, hold_s, end in self.faults():
                self.wait_caught_up()
                row = {
                    "fault": name,
                    "training": self.train.poll() is None,
                    "trainer_version": self.trainer_version(),
                    "t": time.time(),
                }
                begin()
                time.sleep(min(5.0, hold_s))
                row["dashboard_during"] = self.dashboard()
                time.sleep(max(0.0, hold_s - 5.0))
                end()
                row["held_at_end"] = held_version(self.rollout_url, self.token)
                recovery = self.wait_caught_up()
                row["recovery_s"] = None if recovery is None else round(recovery, 1)
                row["training_after"] = self.train.poll() is None
                self.rows.append(row)
                print(
                    f"[       fault] {name}: at trainer v{row['trainer_version']} (training "
                    f"{'running' if row['training'] else 'OVER'}); dashboard: "
                    f"{row['dashboard_during']}; caught up {row['recovery_s']}s after",
                    flush=True,
                )
        except BaseException as e:  # reported by the journey
            self.error = e

    def faults(self):
        hub = self.hub

        def arm(fault: dict):
            return lambda: hub.admin("POST", "/admin/faults", fault)

        def clear():
            hub.admin("DELETE", "/admin/faults")

        def revoke():
            hub.admin("POST", "/admin/tokens/rollout-space/revoke")

        def restore():
            hub.admin("POST", "/admin/tokens/rollout-space/restore")

        def kill():
            hub.stop(kill=True)

        def restart():
            hub.start()

        return [
            ("429 storm, 20 s", arm({"kind": "429", "seconds": 20, "retry_after_s": 3}), 20, clear),
            ("503 for 30 s", arm({"kind": "503", "seconds": 30}), 30, clear),
            ("rollout token revoked, 20 s", revoke, 20, restore),
            ("Hub killed, restarted after 5 s", kill, 5, restart),
        ]

    def report(self) -> list[dict]:
        return json.loads(json.dumps(self.rows))
