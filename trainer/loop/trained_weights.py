"""What a run trains and publishes: every weight, or a LoRA adapter on the frozen model. The one
place the switch is decided; the rest of the trainer asks the object :func:`trained_weights`
returns (the PEFT config TRL wraps the model with, what the publisher records, the replica's
environment, the model name rollouts request, what the trainer does before its first sync, and
the digest the summary compares with the bucket's)."""

from __future__ import annotations

from trainer.settings import AdapterConfigError, AdapterSettings


class FullWeights:
    """Every weight is trained and published (the default): no PEFT, full-weight manifests, the
    replica serves its model under its own name."""

    kind: str | None = None
    served_name: str | None = None  # the model name rollouts and evaluations request (None: any)

    def peft_config(self):
        """TRL's ``peft_config`` argument (None: train the model itself)."""
        return None

    def publisher_info(self, model_path: str):
        """The ``deltasync.manifest.AdapterInfo`` every manifest records (None: full weights)."""
        return None

    def replica_env(self) -> dict[str, str]:
        """The environment a rollout replica of this run needs (``spaces/vllm-rollout``)."""
        return {}

    def check_processes(self, world: int) -> None:
        """Refuse a process count this kind of run cannot train with (any, for full weights)."""

    def prepare_trainer(self, trainer, transfer, publisher) -> None:
        """Make the built trainer publish this kind of weights (nothing to do for full ones)."""

    def trained_digest(self, trainer) -> str:
        """Model digest (``deltasync.manifest.model_digest``) of what the run publishes, from
        the trainer's own model (bf16, named as TRL streams them): equal to the final version's
        manifest digest when the bucket holds the trainer's state."""
        from deltasync.bf16 import digest, to_bf16_bits
        from deltasync.manifest import model_digest

        params = trainer.model.named_parameters()
        return model_digest({n: digest(to_bf16_bits(p)) for n, p in params})

    def summary(self) -> dict:
        """The summary's fields (what ``make eval``'s replicas need to serve the run)."""
        return {
            "adapter": self.kind,
            "adapter_name": self.served_name,
            "replica_env": self.replica_env(),
        }


class LoraAdapter(FullWeights):
    """A LoRA adapter on the frozen model (``ADAPTER=lora``): TRL wraps the model with PEFT, the
    publisher records the adapter and its base's digest (``trainer.loop.adapter``), the replicas
    load each version under ``{name}-v{N}`` and serve the stable ``name``.

    Args:
        settings: the run's :class:`~trainer.config.AdapterSettings` (``kind`` ``lora``).
    """

    def __init__(self, settings: AdapterSettings):
        self.settings = settings
        self.kind = settings.kind
        self.served_name = settings.name

    def peft_config(self):
        from trainer.loop.adapter import lora_config

        return lora_config(self.settings)

    def publisher_info(self, model_path: str):
        """The adapter's PEFT config and the digest of the base weights in ``model_path``
        (``trainer.loop.adapter.adapter_info``; no model is built for it)."""
        from trainer.loop.adapter import adapter_info

        return adapter_info(self.settings, model_path)

    def replica_env(self) -> dict[str, str]:
        """``ADAPTER``, ``ADAPTER_NAME`` and ``MAX_LORA_RANK`` (the rank rounded up to one vLLM
        builds buffers for).

        Raises:
            AdapterConfigError: the rank is larger than any vLLM serves.
        """
        from trainer.loop.adapter import max_lora_rank

        return {
            "ADAPTER": self.kind,
            "ADAPTER_NAME": self.served_name,
            "MAX_LORA_RANK": str(max_lora_rank(self.settings)),
        }

    def check_processes(self, world: int) -> None:
        """Adapter runs train in one process for now: the transfer reads the adapter on rank 0
        without TRL's per-parameter stream, which under FSDP2 is a collective every rank joins.

        Raises:
            AdapterConfigError: ``world`` > 1.
        """
        if world > 1:
            raise AdapterConfigError(
                f"ADAPTER={self.kind}: expected one trainer process, found {world} (NPROC); "
                "train the adapter with NPROC=1, or unset ADAPTER to train full weights on several"
            )

    def prepare_trainer(self, trainer, transfer, publisher) -> None:
        """Check TRL's PEFT model against the adapter the publisher records (its base by digest:
        the base is built once, by TRL), restore the newest published adapter on a restart, keep
        the model unmerged, let the transfer publish the adapter's tensors and the rollouts
        request :attr:`served_name`.

        Raises:
            AdapterConfigError: TRL refuses the adapter for vLLM.
            deltasync.errors.AdapterMismatchError, deltasync.errors.WrongBaseModelError: the
                trainer's PEFT model is not the adapter the publisher records.
        """
        from trainer.loop import adapter, trl_compat

        model = trainer.accelerator.unwrap_model(trainer.model)
        if publisher is not None:
            adapter.check_trainer_model(model, publisher.adapter)
            adapter.restore_from_bucket(model, publisher)  # a restart goes on from the bucket
        trl_compat.keep_adapter_unmerged(model)
        transfer.adapter_fn = lambda: adapter.adapter_tensors(model)
        trl_compat.set_request_model(trainer, self.served_name)

    def trained_digest(self, trainer) -> str:
        """The digest of the adapter's tensors as bf16 (``trainer.loop.adapter.adapter_digest``)."""
        from trainer.loop.adapter import adapter_digest

        return adapter_digest(trainer.accelerator.unwrap_model(trainer.model))


def trained_weights(settings: AdapterSettings) -> FullWeights:
    """The object for ``settings``: :class:`LoraAdapter` when ``settings.kind`` is ``lora``, else
    :class:`FullWeights`."""
    return LoraAdapter(settings) if settings.kind == "lora" else FullWeights()
