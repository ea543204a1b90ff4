"""Control of the internal vLLM server over its dev-mode HTTP routes (127.0.0.1 only).

``VLLMControl`` is what the sync loop drives: ``pause(mode=keep)``, ``apply`` (a worker-extension
call through ``/collective_rpc``), ``set_version`` (``/update_weight_version``, read back by
``GET /weight_info``), ``reset_prefix_cache``, ``resume`` and ``served_digests`` (the
full-weights check); on a LoRA replica
``load_lora`` / ``unload_lora`` (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, served
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and ``lora_adapters``. Every call raises
``EngineControlError`` on a non-2xx answer or a transport failure; none is retried here.
"""

from __future__ import annotations

from typing import Protocol

import httpx


class EngineControlError(RuntimeError):
    """A control call to the internal vLLM server failed (status and body in the message)."""


class Engine(Protocol):
    """What the sync loop needs from the serving engine (:class:`VLLMControl` for a real server,
    a fake in tests). Each call raises ``EngineControlError`` when it fails."""

    def describe(self) -> dict: ...
    def apply(self, path: str, mode: str) -> list[dict]: ...
    def pause(self, mode: str = "keep") -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def served_digests(self) -> dict[str, str]: ...


class VLLMControl:
    """Client of one vLLM OpenAI server started with ``VLLM_SERVER_DEV_MODE=1`` and the
    ``rollout.extension.DeltaSyncExtension`` worker extension.

    Args:
        base_url: ``http://127.0.0.1:<port>`` of the internal server.
        timeout_s: per-call timeout in seconds (an apply of a large model may take a while).
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        # No keep-alive: after a failed call vLLM's server drops the connection, and a pooled
        # connection would turn the next control call into a spurious "connection reset".
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout_s,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise EngineControlError(f"{method} {self.base_url}{path} failed: {e!r}") from e
        if r.status_code // 100 != 2:
            raise EngineControlError(
                f"{method} {self.base_url}{path}: expected 2xx, found {r.status_code}: "
                f"{r.text[:2000]}"
            )
        return r

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 (False on any transport error)."""
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def rpc(self, method: str, *args: str, **kwargs: str) -> list:
        """Call a worker method on every worker; returns the per-worker results."""
        body = {"method": method, "args": list(args), "kwargs": kwargs}
        return self._call("POST", "/collective_rpc", json=body).json()["results"]

    def describe(self) -> dict:
        """The extension's model report (first worker's)."""
        return self.rpc("deltasync_describe")[0]

    def apply(self, path: str, mode: str) -> list[dict]:
        """Apply a staging file on every worker (``mode``: reload | in-place)."""
        return self.rpc("deltasync_apply", path, mode)

    def pause(self, mode: str = "keep") -> None:
        """Stop scheduling; ``keep`` freezes in-flight requests with their KV cache."""
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused").json()["is_paused"])

    def set_version(self, version: int) -> None:
        """Record the served weight version (what ``GET /weight_info`` reports)."""
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    def weight_version(self) -> str:
        return str(self._call("GET", "/weight_info").json()["weight_version"])

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes computed with the old weights. False while blocks are held by
        requests (e.g. ones frozen by a keep-pause); the sync loop retries later."""
        return bool(self._call("POST", "/reset_prefix_cache").json().get("success", False))

    def served_digests(self) -> dict[str, str]:
        """{checkpoint tensor: xxh3-64 of its bf16 bits as the engine computes with it}
        (``rollout.worker_apply.served_digests``, one worker). vLLM's own ``/weight_checker``
        checksums its parameters, which on the CPU build are empty once the GEMM weights are
        packed into oneDNN / SGL handles; this reads every linear weight back through its kernel."""
        return dict(self.rpc("deltasync_served_digests")[0]["digests"])

    def lora_adapters(self) -> list[str]:
        """Names of the LoRA adapters vLLM has loaded (its ``/v1/models`` cards with a parent)."""
        cards = self._call("GET", "/v1/models").json().get("data", [])
        return [c["id"] for c in cards if c.get("parent")]

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT folder ``path`` as adapter ``name`` (vLLM reads and checks it now).
        A name that is loaded already is refused (400): every version gets a new name."""
        self._call("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (404 when vLLM has no such adapter)."""
        self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
