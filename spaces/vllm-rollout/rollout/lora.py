"""LoRA adapter runs on a replica (``ADAPTER=lora``): which runs it serves, and which adapter
version each request gets. No torch, no vLLM.

A replica started with ``ADAPTER=lora`` serves its base model (``MODEL``) and follows an adapter
run: the bucket holds only the adapter's tensors (PEFT keys, bf16) and every manifest names the
adapter (``deltasync.manifest.AdapterInfo``: kind, PEFT config, base digest).

- Which runs: :class:`CheckedSubscriber` checks every manifest it reads before anything is
  planned or downloaded (:func:`check_run`): a full-weight run on a LoRA replica (or the
  reverse), an adapter of another base model, or a rank above ``MAX_LORA_RANK`` is refused with
  :class:`RunRefusedError`; the replica reports it and keeps serving what it holds.
- Which version: each verified version N is loaded into vLLM as ``{ADAPTER_NAME}-v{N}`` (a new
  name per version: vLLM keys its prefix cache on the adapter name, so no block computed with
  another version is ever reused). :class:`AdapterRoutes` maps the stable ``ADAPTER_NAME`` to
  the newest loaded one when a request arrives and counts the requests in flight per versioned
  name, so a request finishes on the version it started on, and an old version is unloaded only
  once no request uses it (``rollout.lora_load``).
- Which names clients see: the front's ``GET /v1/models`` lists the stable name (one card,
  ``parent`` the base model) in place of the versioned names vLLM holds (:func:`public_cards`).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass

from deltasync.adapter import check_base, run_adapter
from deltasync.errors import AdapterMismatchError, ManifestError, WrongBaseModelError
from deltasync.manifest import Manifest
from deltasync.subscriber import DeltaSubscriber

from .config import round_lora_rank


@dataclass(frozen=True)
class AdapterTarget:
    """What a LoRA replica serves.

    Attributes:
        name: the stable adapter name clients request (``ADAPTER_NAME``, e.g. ``policy``); each
            version N is loaded as ``{name}-v{N}``.
        base_digest: ``deltasync.adapter.base_digest_of_folder`` of the served base model.
        max_rank: vLLM's ``--max-lora-rank``: the largest adapter rank it can load.
        base_model: the served model (hub id or folder), named in errors.
    """

    name: str
    base_digest: str
    max_rank: int = 16
    base_model: str = ""

    def versioned(self, version: int) -> str:
        """The name vLLM serves version ``version`` under."""
        return f"{self.name}-v{version}"


class RunRefusedError(ManifestError):
    """The run's manifest is valid, but this replica cannot serve the run: an adapter run on a
    full-weight replica or the reverse, an adapter of another base model, or a LoRA rank above
    the replica's ``MAX_LORA_RANK``. The message starts with the underlying error's type."""


def check_run(manifest: Manifest, target: AdapterTarget | None, where: str) -> None:
    """Refuse a run this replica cannot serve (``target`` None: a full-weight replica).

    Raises:
        RunRefusedError: from ``AdapterMismatchError`` (the run's kind differs),
            ``WrongBaseModelError`` (another base model), or a rank above ``target.max_rank``.
    """
    try:
        adapter = run_adapter(manifest, "lora" if target is not None else None, where)
        if target is None or adapter is None:
            return
        check_base(adapter, target.base_digest, target.base_model or None)
    except (AdapterMismatchError, WrongBaseModelError) as e:
        raise RunRefusedError(f"{type(e).__name__}: {e}") from e
    rank = adapter.peft_config["r"]
    if rank > target.max_rank:
        raise RunRefusedError(
            f"{where}: the adapter's rank is {rank}, this replica loads ranks up to "
            f"{target.max_rank}; restart it with MAX_LORA_RANK={round_lora_rank(rank)}"
        )


class CheckedSubscriber(DeltaSubscriber):
    """A ``DeltaSubscriber`` whose manifest reads refuse a run this replica cannot serve
    (:func:`check_run`), before any plan or download. ``Follower.poll`` reports the
    ``RunRefusedError`` (a ``ManifestError``) and polls on; nothing held changes.

    Args:
        store: the run's Store or URI.
        target: what a LoRA replica serves; None for a full-weight replica.
        kw: ``DeltaSubscriber`` arguments.
    """

    def __init__(self, store, target: AdapterTarget | None = None, **kw):
        super().__init__(store, **kw)
        self.target = target

    def read_manifest(self) -> Manifest | None:
        """``DeltaSubscriber.read_manifest``, checked.

        Raises:
            RunRefusedError: see :func:`check_run`; and what ``read_manifest`` raises.
        """
        manifest = super().read_manifest()
        if manifest is not None:
            check_run(manifest, self.target, self.store.uri)
        return manifest


@dataclass(frozen=True)
class Lease:
    """One request's use of a loaded adapter version: ``name`` (``policy-v3``), ``version``."""

    name: str
    version: int


class AdapterRoutes:
    """The adapter versions requests can use, shared by the front (event loop) and the sync
    loop (its thread); every method takes one lock.

    A request whose ``model`` is the stable name gets the newest published version; one that
    names a loaded versioned name (``policy-v3``) gets that one. Each is counted until released;
    a version that is not the newest and has no request in flight is retired by
    :meth:`take_idle` (no longer routable; the caller unloads it).

    Args:
        name: the stable adapter name (``ADAPTER_NAME``).
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._current: Lease | None = None
        self._routable: dict[str, int] = {}  # versioned name -> version, loaded in vLLM
        self._in_flight: Counter[str] = Counter()

    @property
    def current(self) -> Lease | None:
        """The newest published version (None before the first)."""
        with self._lock:
            return self._current

    def publish(self, name: str, version: int) -> None:
        """Route the stable name to ``name`` (version ``version``), loaded in vLLM just now."""
        with self._lock:
            self._current = Lease(name, version)
            self._routable[name] = version

    def acquire(self, model: str) -> Lease | None:
        """The version a request for ``model`` uses (counted until :meth:`release`), or None
        when ``model`` is neither the stable name with a version published nor a routable
        versioned name (the request then is not an adapter request, or must wait)."""
        with self._lock:
            if model == self.name:
                lease = self._current
            elif model in self._routable:
                lease = Lease(model, self._routable[model])
            else:
                return None
            if lease is not None:
                self._in_flight[lease.name] += 1
            return lease

    def release(self, lease: Lease) -> None:
        """The request that held ``lease`` is finished (its response sent or abandoned)."""
        with self._lock:
            self._in_flight[lease.name] -= 1
            if self._in_flight[lease.name] <= 0:
                del self._in_flight[lease.name]

    def in_flight(self, name: str) -> int:
        """Requests in flight on versioned name ``name``."""
        with self._lock:
            return self._in_flight.get(name, 0)

    def take_idle(self) -> list[str]:
        """Versioned names that are not the newest and have no request in flight; they are no
        longer routable from now on (unload them)."""
        with self._lock:
            current = self._current.name if self._current else None
            idle = [n for n in self._routable if n != current and not self._in_flight.get(n)]
            for n in idle:
                del self._routable[n]
            return idle


@dataclass(frozen=True)
class Routed:
    """A request body after routing: ``body`` to send upstream, the ``lease`` it holds (None:
    not an adapter request), and ``waiting`` (it asked for the stable name before any version
    was published: answer 503)."""

    body: bytes
    lease: Lease | None = None
    waiting: bool = False


def route_body(body: bytes, routes: AdapterRoutes) -> Routed:
    """Route one ``/v1`` request body: a JSON object whose ``model`` is the stable name is
    rewritten to the newest versioned name; a loaded versioned name is kept. Either is leased
    (release it when the response is done). Other bodies pass unchanged."""
    try:
        doc = json.loads(body)
    except ValueError:
        return Routed(body)  # not JSON: vLLM answers it
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, str):
        return Routed(body)
    lease = routes.acquire(model)
    if lease is None:
        return Routed(body, waiting=model == routes.name)
    if lease.name != model:
        doc["model"] = lease.name
        body = json.dumps(doc).encode()
    return Routed(body, lease)


def public_cards(cards: list, routes: AdapterRoutes) -> list:
    """vLLM's ``/v1/models`` cards as a client of this replica sees them: the cards of the
    versioned names (``policy-v3``) left out, and one card for the stable name (``policy``) in
    their place, a copy of the newest version's (same ``parent``, the base model) with ``id`` and
    ``root`` set to the stable name. Listed only while vLLM holds the version it routes to; the
    base model's and any other cards are kept, in vLLM's order (base first)."""
    current, prefix = routes.current, f"{routes.name}-v"
    out, stable = [], None
    for card in cards:
        cid = card.get("id") if isinstance(card, dict) else None
        if isinstance(cid, str) and cid.startswith(prefix) and cid[len(prefix) :].isdigit():
            if current is not None and cid == current.name:
                stable = dict(card, id=routes.name, root=routes.name)
            continue
        out.append(card)
    return out if stable is None else [*out, stable]
