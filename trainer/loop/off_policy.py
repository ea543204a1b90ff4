"""The per-token policy loss of a GRPO step whose samples are off-policy, in three modes.

Three policies meet in an asynchronous step (log-probabilities per completion token, float32):

- ``log_probs``: pi_theta, the policy being trained (with gradient);
- ``gen_log_probs``: pi_gen, the weights that generated the token, k versions old, as the trainer's
  own forward computes them (rebuilt bit for bit from the bucket: ``deltasync.history``); a sample
  whose turns came from several versions has each turn's tokens from its own version;
- ``sampling_log_probs``: pi_vLLM, what the replica reported when it sampled the token (vLLM's bf16
  kernels: the same weights as pi_gen, another computation).

pi_theta / pi_vLLM = (pi_theta / pi_gen) x (pi_gen / pi_vLLM): the policy's *drift* since the
generating version times the trainer-inference *mismatch*. Modes:

- ``off``: TRL 1.16's AsyncGRPO objective: PPO's clipped ratio against the sampler,
  ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = pi_theta / pi_vLLM``; drift and
  mismatch folded into one ratio (``trl/experimental/async_grpo/async_grpo_trainer.py``,
  ``compute_loss``).
- ``tis``: truncated importance sampling on the mismatch only (Yao et al., "Your efficient RL
  framework secretly brings you off-policy RL training", 2025; the family of TRL PR #7120):
  ``-w * min(r A, clip(r) A)`` with ``w = min(pi_gen / pi_vLLM, cap)`` (no gradient) and the
  ratio taken against the current policy itself (``r = pi_theta / sg(pi_theta)``, 1 in value): the
  sample counts as on-policy except for the mismatch.
- ``decoupled``: decoupled PPO (AReaL: Fu et al., "AReaL: a large-scale asynchronous reinforcement
  learning system for language reasoning", 2025), with the generating policy as the proximal one:
  ``-w * min(r A, clip(r) A)`` with ``r = pi_theta / pi_gen`` and the same truncated ``w``: the
  drift is clipped against the policy that generated the sample, the mismatch weighed by ``w``.

The cap: ``TIS_CAP = 2.0`` (Yao et al. 2025 truncate at C = 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.settings import OFF_POLICY_MODES as MODES

TIS_CAP = 2.0


class OffPolicyModeError(ValueError):
    """An off-policy mode or cap the loss does not know; the message lists the accepted ones."""


@dataclass(frozen=True)
class OffPolicyLoss:
    """The loss settings.

    Attributes:
        mode: one of ``MODES``.
        eps_low, eps_high: PPO's clip range ``[1 - eps_low, 1 + eps_high]`` (TRL's ``epsilon``
            and ``epsilon_high``, 0.2 by default).
        cap: the truncation ``C`` of the mismatch weight ``min(pi_gen / pi_vLLM, C)``.

    Raises (on construction):
        OffPolicyModeError: ``mode`` not in ``MODES``, or ``cap`` not above 1.
    """

    mode: str = "off"
    eps_low: float = 0.2
    eps_high: float = 0.2
    cap: float = TIS_CAP

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise OffPolicyModeError(
                f"off-policy mode {self.mode!r}: expected one of {', '.join(MODES)}"
            )
        if not self.cap > 1.0:
            raise OffPolicyModeError(f"cap={self.cap}: expected a truncation above 1 (e.g. 2)")

    def per_token(
        self,
        log_probs: torch.Tensor,
        gen_log_probs: torch.Tensor | None,
        sampling_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token loss (to be summed and normalised as TRL does) and its statistics.

        Args:
            log_probs: float32[T] pi_theta of the T selected completion tokens (with gradient).
            gen_log_probs: float32[T] pi_gen of the same tokens (no gradient); None only in
                ``off`` mode.
            sampling_log_probs: float32[T] pi_vLLM of the same tokens.
            advantages: float32[T] the token's sample advantage.
            mask: bool[T] the tokens that count (a tool reply's tokens do not); None: all. A
                masked token's loss is 0 and it is left out of the statistics.

        Returns:
            ``(loss[T], stats)``; ``stats`` (no gradient, float32 scalars): ``drift_mean`` /
            ``drift_max`` (pi_theta / pi_gen), ``mismatch_mean`` / ``mismatch_max``
            (pi_gen / pi_vLLM), ``truncated`` (share of tokens whose mismatch weight was
            capped), ``clipped`` (share whose PPO ratio was clipped on the side that matters),
            ``kl`` (k3 estimate of KL(pi_gen || pi_theta) per token, Schulman's ``r - 1 - log r``
            with ``r = pi_theta / pi_gen``). Drift and mismatch are NaN without ``gen_log_probs``.

        Raises:
            OffPolicyModeError: ``gen_log_probs`` is None in a mode that needs it.
        """
        if gen_log_probs is None and self.mode != "off":
            raise OffPolicyModeError(
                f"mode {self.mode!r} weighs tokens by their generating policy: pass "
                "gen_log_probs (the generating version's log-probabilities), or use mode 'off'"
            )
        if mask is None:
            mask = torch.ones_like(advantages, dtype=torch.bool)
        if self.mode == "off":
            ratio, weight = torch.exp(log_probs - sampling_log_probs), None
        elif self.mode == "tis":
            ratio = torch.exp(log_probs - log_probs.detach())
        else:
            ratio = torch.exp(log_probs - gen_log_probs)
        clipped = torch.clamp(ratio, 1 - self.eps_low, 1 + self.eps_high)
        loss = -torch.min(ratio * advantages, clipped * advantages)
        stats: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            nan = torch.tensor(float("nan"))
            low = (ratio < 1 - self.eps_low) & (advantages < 0)
            high = (ratio > 1 + self.eps_high) & (advantages > 0)
            stats["clipped"] = (low | high)[mask].float().mean()
            if gen_log_probs is not None:
                log_drift = log_probs.detach() - gen_log_probs
                drift, mismatch = (
                    torch.exp(log_drift),
                    torch.exp(gen_log_probs - sampling_log_probs),
                )
                stats.update(
                    drift_mean=drift[mask].mean(),
                    drift_max=drift[mask].max(),
                    mismatch_mean=mismatch[mask].mean(),
                    mismatch_max=mismatch[mask].max(),
                    truncated=(mismatch > self.cap)[mask].float().mean(),
                    kl=(drift - 1 - log_drift)[mask].mean(),
                )
                weight = torch.clamp(mismatch, max=self.cap)
            else:
                stats.update(drift_mean=nan, drift_max=nan, mismatch_mean=nan, mismatch_max=nan)
                stats.update(truncated=nan, kl=nan)
        if self.mode != "off":
            loss = weight * loss
        return torch.where(mask, loss, torch.zeros_like(loss)), stats


def k3(log_ratio):
    """Schulman's k3 estimate of KL(q || p) per token, from ``log_ratio = log p - log q`` on
    tokens drawn from q: ``exp(x) - 1 - x`` (unbiased, never negative; J. Schulman,
    "Approximating KL divergence", 2020, joschu.net/blog/kl-approx.html). Elementwise on a
    numpy array or a tensor. Drift: q = pi_gen, p = pi_theta; mismatch: q = pi_vLLM, p = pi_gen."""
    exp = torch.exp if torch.is_tensor(log_ratio) else np.exp
    return exp(log_ratio) - 1 - log_ratio


def kl_by_lag(
    log_probs: torch.Tensor, gen_log_probs: torch.Tensor, lags: torch.Tensor
) -> dict[int, float]:
    """The k3 estimate of KL(pi_gen || pi_theta) per token, averaged per version lag.

    Args:
        log_probs, gen_log_probs: float32[T] as in :meth:`OffPolicyLoss.per_token`.
        lags: int64[T] versions between each token's generating version and the trained one.

    Returns:
        {lag: mean KL estimate over its tokens}, lags in ascending order.
    """
    with torch.no_grad():
        kl = k3(log_probs.detach() - gen_log_probs)
        return {int(lag): float(kl[lags == lag].mean()) for lag in torch.unique(lags).tolist()}
