"""Where a run's credentials may go and which replicas may join its fleet: one allowlist,
:class:`TrustedUrls`, built from the run's settings (:meth:`TrustedUrls.for_run`).

Trusted are:

- the URLs the user gave (``VLLM_URL`` entries, ``ENV_URL``), by origin (scheme, host, port);
- the Spaces ``make spaces`` deployed for this run's bucket owner: the deploy keeps each Space's
  generated secrets in ``runs/spaces/<owner>--<space>.<secret>`` (mode 0600,
  ``tools/deploy_spaces.py``), so those file names say which Spaces it made; a Space
  ``owner/name`` answers at ``https://<owner>-<name>.hf.space`` (lowercased, ``_`` and ``.`` made
  ``-``: ``tools.space_stage.space_url``, huggingface_hub's rule);
- on a local bucket (the local default), loopback replicas: only this machine's processes can
  write their heartbeats there.

The HF token (usually account-wide, write) goes only over ``https`` to a trusted ``*.hf.space``
host (a private Space needs it; no other host does). One exception keeps the offline journey
(``make journey``) working: when ``HF_ENDPOINT`` is a Hub on this machine (``tools/local_hub``),
its tokens are that Hub's own, and its private Spaces answer on loopback ``http`` behind a front
that checks them, so they go to a loopback URL the user gave. A heartbeat in the bucket can be written by
every Space holding a bucket token, so a replica that announces an untrusted URL does not join.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

SPACE_SUFFIX = ".hf.space"
# the deploy's secret files, ``<owner>--<space>.<secret>``; a rollout Space always gets a
# CONTROL_TOKEN (``tools/deploy_spaces.py`` ``_keep_secrets``)
_STATE_FILE = re.compile(
    r"(?P<owner>[A-Za-z0-9][A-Za-z0-9_.-]*?)--(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)"
    r"\.(?P<secret>control_token|rollout_api_key|wordle_api_key)"
)
_ROLLOUT_SECRETS = ("control_token", "rollout_api_key")
REPO_STATE_DIR = str(Path(__file__).resolve().parents[1] / "runs" / "spaces")


def space_host(owner: str, name: str) -> str:
    """The host of Space ``owner/name``: ``<owner>-<name>.hf.space``, lowercased, ``_`` and
    ``.`` replaced by ``-``."""
    return re.sub(r"[_.]", "-", f"{owner}-{name}".lower()) + SPACE_SUFFIX


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin(url: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of ``url`` (the default port filled in; ``ws``/``wss`` read as
    ``http``/``https``), or None when it has no http(s) scheme or host."""
    try:
        p = urlparse(url.strip())
        port = p.port
    except ValueError:
        return None
    scheme = {"ws": "http", "wss": "https"}.get(p.scheme.lower(), p.scheme.lower())
    if scheme not in ("http", "https") or not p.hostname:
        return None
    return scheme, p.hostname.lower(), port or (443 if scheme == "https" else 80)


def local_hub_endpoint() -> bool:
    """Whether ``HF_ENDPOINT`` names a Hub on this machine (``tools/local_hub``; ``make
    journey``), whose tokens are its own."""
    o = origin(os.environ.get("HF_ENDPOINT") or "")
    return o is not None and is_loopback(o[1])


def deployed_spaces(owner: str, state_dirs: list[str] | tuple[str, ...]) -> frozenset[str]:
    """Hosts of the rollout Spaces ``make spaces`` deployed into ``owner`` (read from the names
    of its secret files in ``state_dirs``; folders that do not exist are skipped)."""
    hosts = set()
    for folder in state_dirs:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for fname in names:
            m = _STATE_FILE.fullmatch(fname)
            if m and m["owner"] == owner and m["secret"] in _ROLLOUT_SECRETS:
                hosts.add(space_host(owner, m["name"]))
    return frozenset(hosts)


@dataclass(frozen=True)
class TrustedUrls:
    """The run's allowlist.

    Attributes:
        explicit: origins ``(scheme, host, port)`` of the URLs the user gave (``VLLM_URL``,
            ``ENV_URL``).
        spaces: hosts of the Spaces deployed for this run (``owner-name.hf.space``).
        local_replicas: loopback replicas announced in the bucket may join (a local bucket).
        local_hub: ``HF_ENDPOINT`` is a Hub on loopback (``tools/local_hub``): the HF token is
            that Hub's, and may go over ``http`` to a loopback URL the user gave (its Spaces).
    """

    explicit: frozenset[tuple[str, str, int]] = frozenset()
    spaces: frozenset[str] = frozenset()
    local_replicas: bool = False
    local_hub: bool = False

    @classmethod
    def of(
        cls,
        urls: list[str] | tuple[str, ...] = (),
        spaces: frozenset[str] = frozenset(),
        local_replicas: bool = False,
        local_hub: bool | None = None,
    ) -> TrustedUrls:
        """From URLs as the user wrote them (unparsable ones are left out: they fail where they
        are used). ``local_hub`` None: whether ``HF_ENDPOINT`` is on loopback
        (:func:`local_hub_endpoint`)."""
        origins = frozenset(o for o in (origin(u) for u in urls) if o is not None)
        hub = local_hub_endpoint() if local_hub is None else local_hub
        return cls(origins, frozenset(spaces), local_replicas, hub)

    @classmethod
    def for_run(
        cls,
        bucket_uri: str,
        urls: list[str],
        local_bucket: bool,
        state_dirs: list[str] | tuple[str, ...] = (REPO_STATE_DIR,),
    ) -> TrustedUrls:
        """The allowlist of a run: ``urls`` (its ``VLLM_URL`` entries and ``ENV_URL``, or the
        replica and environment server it started itself), the rollout Spaces deployed for the
        owner of its ``hf://buckets/<owner>/...`` bucket (``state_dirs``: where the deploy kept
        their secret files), and loopback replicas when the bucket is local."""
        spaces: frozenset[str] = frozenset()
        if bucket_uri.startswith("hf://buckets/"):
            owner = bucket_uri[len("hf://buckets/") :].split("/", 1)[0]
            spaces = deployed_spaces(owner, state_dirs)
        return cls.of(urls, spaces, local_replicas=local_bucket)

    def given(self, url: str) -> bool:
        """Whether the user gave ``url``'s origin explicitly."""
        return origin(url) in self.explicit

    def deployed(self, url: str) -> bool:
        """Whether ``url`` is ``https://`` on a Space deployed for this run."""
        o = origin(url)
        return o is not None and o[0] == "https" and o[1] in self.spaces

    def replica_problem(self, url: str) -> str | None:
        """Why a replica announcing ``url`` may not join the fleet, or None when it may."""
        o = origin(url)
        if o is None:
            return "expected http(s)://host[:port]"
        if self.given(url) or self.deployed(url):
            return None
        if self.local_replicas and is_loopback(o[1]):
            return None
        known = ", ".join(sorted(self.spaces)) or "none recorded"
        return (
            "not one of this run's replicas (expected a VLLM_URL entry, a rollout Space deployed "
            f"for this bucket's owner ({known})"
            + (", or a loopback replica" if self.local_replicas else "")
            + "); if it is yours, add it to VLLM_URL"
        )

    def may_send_hf_token(self, url: str) -> bool:
        """Whether the HF token may go to ``url``: ``https://`` on a ``*.hf.space`` host that the
        user gave or that was deployed for this run; with a local Hub (:attr:`local_hub`), a
        loopback URL the user gave."""
        o = origin(url)
        if o is None:
            return False
        if self.local_hub and is_loopback(o[1]):  # a local Hub's Space: its own token
            return self.given(url)
        if o[0] != "https" or not o[1].endswith(SPACE_SUFFIX):
            return False
        return self.given(url) or self.deployed(url)

    def may_send_key(self, url: str) -> bool:
        """Whether a key of the run's own replicas (``ROLLOUT_API_KEY``) may go to ``url``: a
        URL that may join the fleet."""
        return self.replica_problem(url) is None
