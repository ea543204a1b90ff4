"""Loading verified adapter versions into vLLM, and unloading the ones no request needs.

A LoRA replica's sync loop verifies each adapter version like a weight version (the held
tensors are the adapter's), then :class:`AdapterLoader`:

1. writes the version as a PEFT folder (``deltasync.adapter.write_peft_folder``: temp folder +
   rename) under ``{stage_dir}/adapters/{replica_id}/{name}-v{N}``;
2. loads it with vLLM's ``POST /v1/load_lora_adapter`` under ``{name}-v{N}`` (vLLM reads and
   checks it there), then routes the stable name to it (``rollout.lora.AdapterRoutes``). No
   generation pause: requests in flight keep their own adapter name;
3. at every poll, unloads (``/v1/unload_lora_adapter``) each older version that no request uses
   any more, and deletes its folder at the next poll: vLLM reads ``lora_path`` lazily (an
   adapter evicted from its cache is read again), so a folder is deleted only after its name is
   gone, one poll later.

At start (:meth:`AdapterLoader.reset`) the adapters a previous life of this replica left loaded
in vLLM under ``{name}-v*`` are unloaded and its folder is emptied, so a restarted sync loop
loads its first version under a free name.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from typing import Protocol

from deltasync.adapter import write_peft_folder
from deltasync.manifest import AdapterInfo

from .lora import AdapterRoutes, AdapterTarget
from .staging import private_stage_dir

log = logging.getLogger("rollout.lora")


class LoraEngine(Protocol):
    """What the loader needs from the engine (``rollout.engine.VLLMControl``). Each call raises
    ``EngineControlError`` when it fails."""

    def lora_adapters(self) -> list[str]: ...
    def load_lora(self, name: str, path: str) -> None: ...
    def unload_lora(self, name: str) -> None: ...


class AdapterLoader:
    """Loads adapter versions into vLLM under versioned names; unloads retired ones.

    Args:
        engine: the engine control.
        target: what the replica serves (stable name, base digest, max rank).
        folder: where the PEFT folders go (``{stage_dir}/adapters/{replica_id}``, owned by this
            replica alone: :meth:`reset` empties it).
    """

    def __init__(self, engine: LoraEngine, target: AdapterTarget, folder: str):
        self.engine = engine
        self.target = target
        self.folder = folder
        self.routes = AdapterRoutes(target.name)
        self._unloading: list[str] = []  # retired names whose unload has not succeeded yet
        self._unloaded: list[str] = []  # folders of names unloaded at an earlier poll

    def folder_for(self, version: int) -> str:
        """The PEFT folder of version ``version``."""
        return os.path.join(self.folder, self.target.versioned(version))

    def reset(self) -> list[str]:
        """Unload the ``{name}-v*`` adapters vLLM holds (left by a previous life of this
        replica) and empty :attr:`folder`. Returns the names unloaded.

        Raises:
            EngineControlError: vLLM did not list or unload them.
        """
        mine = re.compile(re.escape(self.target.name) + r"-v[0-9]+")
        stale = [n for n in self.engine.lora_adapters() if mine.fullmatch(n)]
        for name in stale:
            self.engine.unload_lora(name)
        _remove(self.folder)  # nothing loaded reads it any more
        private_stage_dir(self.folder)  # under the staging folder, as private as it
        if stale:
            log.warning("unloaded adapters a previous sync loop left in vLLM: %s", stale)
        return stale

    def load(self, tensors: dict, adapter: AdapterInfo, version: int) -> tuple[float, float]:
        """Write version ``version`` as a PEFT folder, load it into vLLM, and route the stable
        name to it.

        Args:
            tensors: {PEFT key: np.uint16 bf16 bits}, the verified held tensors.
            adapter: the run's adapter (its PEFT config goes to ``adapter_config.json``).
            version: the version they are.

        Returns:
            (seconds writing the folder, seconds of the load call).

        Raises:
            EngineControlError: vLLM refused or failed the load (nothing routed to it; the
                folder stays for a retry, which writes it again).
            OSError: the folder could not be written.
        """
        t0 = time.perf_counter()
        dst = self.folder_for(version)
        _remove(dst)  # a failed load's folder, if any: vLLM never served it
        write_peft_folder(tensors, adapter, dst)
        t1 = time.perf_counter()
        name = self.target.versioned(version)
        self.engine.load_lora(name, dst)
        t2 = time.perf_counter()
        self.routes.publish(name, version)
        return t1 - t0, t2 - t1

    def retire(self) -> list[str]:
        """Delete the folders of names unloaded at an earlier call, then unload every older
        version no request uses (its folder is deleted at the next call). Returns the names
        unloaded now.

        Raises:
            EngineControlError: an unload failed (retried at the next call).
        """
        for path in self._unloaded:
            _remove(path)
        self._unloaded = []
        self._unloading += self.routes.take_idle()
        done = []
        while self._unloading:
            name = self._unloading[0]
            self.engine.unload_lora(name)
            self._unloading.pop(0)
            self._unloaded.append(os.path.join(self.folder, name))
            done.append(name)
        if done:
            log.info("unloaded adapters no request uses: %s", done)
        return done


def _remove(path: str) -> None:
    """Delete folder ``path`` and what it holds; a folder that is gone already is fine."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
