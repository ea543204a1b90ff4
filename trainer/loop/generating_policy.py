"""The generating policy of each sample, rebuilt from the bucket, and the off-policy correction
applied as the trainer takes samples from TRL's queue.

:class:`GeneratingPolicy` computes a sample's log-probabilities under the versions that generated
its turns: the weights of version v come bit for bit from a ``deltasync.history.VersionHistory``
that follows the run's own bucket, loaded into a model built once per version (a few kept, the
newest used). :class:`OffPolicyCorrection` wraps TRL's rollout queue (as
``trainer.loop.advantages.CentredAdvantages`` does) and, per ``trainer.loop.off_policy`` mode,
rewrites what TRL's loss reads, so TRL's own loss computes the corrected objective:

- ``decoupled``: each completion token's ``old_log_probs`` becomes pi_gen (TRL's PPO ratio is then
  pi_theta / pi_gen, clipped against the generating policy), and the sample's advantage is
  multiplied by the truncated mismatch weight ``w = min(exp(mean_t(log pi_gen - log pi_vLLM)),
  cap)``;
- ``tis``: ``old_log_probs`` becomes the current policy's (the ratio is 1 at the step: no drift
  correction) and the advantage is multiplied by the same ``w``;
- ``off``: nothing changes (TRL's objective), the statistics are still recorded when asked.

The recomputation takes the samples queued at once together: one decoder forward per generating
version over them, the LM head only on the completion positions (``batch_log_probs``).

``w`` is one weight per sample, the geometric mean of its tokens' ratios, truncated at ``cap``
(TRL's loss takes one advantage per sample; a per-sample weight w > 0 leaves PPO's min unchanged:
``w min(rA, clip(r)A) = min(r wA, clip(r) wA)``). The per-token form is
``trainer.loop.off_policy.OffPolicyLoss``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np
import torch
from transformers import TrainerCallback

from deltasync.history import VersionHistory
from trainer.loop.off_policy import OffPolicyLoss, k3

log = logging.getLogger("trainer.loop.generating_policy")


# Tokens one decoder forward takes (rows x padded width), and the logits bytes one LM-head slice
# may hold (float32 [positions, vocab]: 256 MiB is ~13,000 positions of the local model's 5,056-
# entry vocabulary, 1,365 of SmolLM2's 49,152).
FORWARD_TOKENS = 16384
LOGITS_BUDGET_BYTES = 256 * 2**20


def batch_log_probs(
    model, sequences: list[np.ndarray], wanted: list[np.ndarray] | None = None
) -> list[np.ndarray]:
    """``log p(ids[p] | ids[:p])`` of each sequence at its ``wanted`` positions, without
    gradient, in few forwards.

    The sequences, shortest first, are right-padded into decoder forwards of at most
    ``FORWARD_TOKENS`` tokens (a longer sequence gets a forward alone); right padding with an
    attention mask leaves every real position's causal context as it was. Only the positions
    scored go through the LM head (``model.get_output_embeddings()`` on the decoder's last
    hidden state, ``LOGITS_BUDGET_BYTES`` of logits at a time), as TRL's own loss scores only the
    trained positions: in a Wordle episode ~89% of the positions are prompt and tool text. This
    is the logits of causal LMs whose head is that linear map (Qwen, Llama, SmolLM2, Mistral).
    The forward runs in the model's dtype: for a float32 model (``GeneratingPolicy``'s) the
    values equal a whole forward's up to float32 summation order (about 1e-6); a bf16 model's
    padded and unpadded forwards differ by up to ~1e-2 where bf16 is emulated (AVX2).

    Args:
        model: a causal LM (``get_decoder()``, ``get_output_embeddings()``).
        sequences: token ids, int[L_i] each.
        wanted: bool[L_i] per sequence, the positions p >= 1 to score (None: all).

    Returns:
        float32[L_i] per sequence, in order: ``log p(ids[p] | ids[:p])`` where wanted, else NaN.
    """
    wanted = wanted if wanted is not None else [np.arange(len(s)) > 0 for s in sequences]
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    budget = max(1, LOGITS_BUDGET_BYTES // (4 * int(head.weight.shape[0])))
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out = [np.full(len(s), np.nan, dtype=np.float32) for s in sequences]
    start = 0
    while start < len(order):
        end = start + 1  # sorted by length: the chunk's last sequence is its longest
        while end < len(order) and (end + 1 - start) * len(sequences[order[end]]) <= FORWARD_TOKENS:
            end += 1
        rows = order[start:end]
        width = max(len(sequences[i]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : len(sequences[i])] = torch.as_tensor(
                np.asarray(sequences[i]), dtype=torch.long
            )
            attention[r, : len(sequences[i])] = 1
        # scored (row, p): the hidden state at p - 1 predicts the token at p
        at = [(r, p) for r, i in enumerate(rows) for p in np.flatnonzero(wanted[i]) if p >= 1]
        if at:
            row = torch.tensor([r for r, _ in at])
            pos = torch.tensor([int(p) for _, p in at])
            with torch.no_grad():
                hidden = decoder(
                    input_ids=ids.to(device), attention_mask=attention.to(device)
                ).last_hidden_state[row.to(device), (pos - 1).to(device)]
                targets = ids[row, pos].to(device)
                lp = (
                    torch.cat(
                        [
                            torch.log_softmax(head(hidden[k : k + budget]).float(), dim=-1).gather(
                                1, targets[k : k + budget, None]
                            )[:, 0]
                            for k in range(0, len(at), budget)
                        ]
                    )
                    .cpu()
                    .numpy()
                )
            for k, (r, p) in enumerate(at):
                out[rows[r]][p] = lp[k]
        start = end
    return out


def position_versions(length: int, turns: list[tuple[int, int]]) -> np.ndarray:
    """int64[length]: the version that generated each position (-1: none known), from the
    sample's turns ``(end, version)`` in order: a turn's tokens end at ``end``, so position p
    belongs to the first turn whose ``end`` is above p."""
    out = np.full(length, -1, dtype=np.int64)
    if not turns:
        return out
    ends = np.array([e for e, _ in turns])
    versions = np.array([v for _, v in turns])
    idx = np.searchsorted(ends, np.arange(length), side="right")
    inside = idx < len(turns)
    out[inside] = versions[idx[inside]]
    return out


class GeneratingPolicy:
    """Log-probabilities under the bucket versions that generated each token.

    Args:
        build_model: ``f() -> torch.nn.Module``: a fresh model of the run's architecture (its
            weights are replaced by a version's).
        history: the run's ``VersionHistory`` (the kept versions).
        models: models kept built, one per version (the newest used kept).
    """

    def __init__(self, build_model: Callable[[], torch.nn.Module], history, models: int = 3):
        self.build_model, self.history, self.models = build_model, history, models
        self._built: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self._lock = threading.Lock()

    def model_at(self, version: int) -> torch.nn.Module:
        """The model with the weights of ``version`` (bf16 as published, computed in float32).

        float32 on purpose, whatever dtype ``build_model`` gives (transformers 5 builds a model
        in its config's dtype, bf16 for most checkpoints): the published bf16 values upcast
        exactly, and a float32 forward is the same function on every processor, while bf16
        matmuls differ between ISAs (native AVX-512 BF16 / AMX against emulation on AVX2) by
        up to ~1e-2 in a log-probability. The replica's own numbers are not reproduced: vLLM's
        kernels differ from a plain forward in any dtype.

        Raises:
            deltasync.errors.VersionNotKeptError: the history cannot rebuild ``version``.
        """
        from deltasync.bf16 import from_bf16_bits

        with self._lock:
            if version in self._built:
                self._built.move_to_end(version)
                return self._built[version]
            if version not in self.history.versions():
                self.history.update()
            bits = self.history.weights_at(version)
            model = self._built.popitem(last=False)[1] if len(self._built) >= self.models else None
            model = model if model is not None else self.build_model().to(torch.float32)
            state = {n: from_bf16_bits(np.array(b)).float() for n, b in bits.items()}
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected or any(not _tied(n) for n in missing):
                raise ValueError(
                    f"version {version}'s tensors do not fit the model: missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}"
                )
            model.eval()
            self._built[version] = model
            return model

    def log_probs(self, input_ids: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """float32[L]: each position's log-probability under its own version (``versions``,
        int64[L], -1: none known -> NaN).

        Raises:
            deltasync.errors.VersionNotKeptError: a version the history cannot rebuild.
        """
        return self.log_probs_many([(input_ids, versions)])[0]

    def log_probs_many(
        self, items: list[tuple[np.ndarray, np.ndarray]], missing: dict[int, str] | None = None
    ) -> list[np.ndarray]:
        """:meth:`log_probs` of several samples ``(input_ids, versions)``, one batched forward
        (``batch_log_probs``) per version over the samples that have tokens of it, oldest
        version first (rebuilding a newer one may move the history past an older one).

        Args:
            missing: if given, a version the history cannot rebuild is added to it (with the
                error's message) and its positions are left NaN, instead of raising.

        Raises:
            deltasync.errors.VersionNotKeptError: a version the history cannot rebuild (when
                ``missing`` is None).
        """
        from deltasync.errors import DeltaSyncError

        out = [np.full(len(ids), np.nan, dtype=np.float32) for ids, _ in items]
        wanted = sorted({int(v) for _, versions in items for v in versions[versions >= 0]})
        for v in wanted:
            try:
                model = self.model_at(v)
            except DeltaSyncError as e:  # not kept, or the history refused a damaged delta
                if missing is None:
                    raise
                missing[v] = str(e)
                continue
            rows = [i for i, (_, versions) in enumerate(items) if (versions == v).any()]
            here = [items[i][1] == v for i in rows]
            lps = batch_log_probs(model, [items[i][0] for i in rows], here)
            for i, lp, h in zip(rows, lps, here, strict=True):
                out[i][h] = lp[h]
        return out


def _tied(name: str) -> bool:
    return name.endswith("lm_head.weight")  # tied to the embedding: not published on its own


class OffPolicyCorrection:
    """TRL's rollout queue with each sample's ``old_log_probs`` and advantage rewritten for
    ``loss.mode`` (see the module docstring), and the statistics of what it saw.

    A ``get`` that finds its buffer empty takes one sample from ``inner`` (blocking as TRL asked)
    and then, without waiting, up to ``batch - 1`` more that are already queued, and corrects them
    together: one batched forward per generating version instead of one per sample and version.
    The samples are handed out in queue order; TRL's staleness check sees each as it is handed out.

    Args:
        inner: the queue TRL's dataset reads (``get`` returns TRL's ``RolloutSample``).
        loss: the mode and cap (``trainer.loop.off_policy.OffPolicyLoss``).
        policy: :class:`GeneratingPolicy`.
        turns_fn: a sample's token ids -> its turns ``(end, bucket version)``
            (``trainer.fleet.affinity.EpisodeAffinity.turn_versions``).
        current_fn: ``f([int[L_i], ...], [bool[L_i], ...]) -> [float32[L_i], ...]``: the
            current policy's log-probabilities at the given positions (the drift's statistics;
            ``tis``'s ratio).
        newest_fn: ``f() -> int | None``: the newest published version (for the lag).
        batch: the most samples corrected together (a bound on how far the buffer runs ahead
            of TRL's reads).
        drift_every: the drift's statistics (``kl_drift_lag*``) score one sample in this many
            under the current policy (one forward over all of them costs about as much as the
            generating policy's; ``tis`` scores every sample, its ratio needs them).
    """

    def __init__(
        self,
        inner,
        loss: OffPolicyLoss,
        policy,
        turns_fn,
        current_fn,
        newest_fn,
        batch: int = 16,
        drift_every: int = 4,
    ):
        self._inner, self.loss, self.policy = inner, loss, policy
        self.turns_fn, self.current_fn, self.newest_fn = turns_fn, current_fn, newest_fn
        self.batch, self.drift_every, self._seen = batch, drift_every, 0
        self._ready: deque = deque()
        self._stats: list[dict] = []
        self._lock = threading.Lock()

    def get(self, *args, **kwargs):
        if not self._ready:
            samples = [self._inner.get(*args, **kwargs)]
            while len(samples) < self.batch:
                try:
                    samples.append(self._inner.get_nowait())
                except queue.Empty:  # nothing more queued now: correct what was taken
                    break
            self.correct_many(samples)
            self._ready.extend(samples)
        return self._ready.popleft()

    def qsize(self) -> int:
        """Samples queued, the corrected ones not yet handed out included."""
        return self._inner.qsize() + len(self._ready)

    def correct_many(self, samples: list) -> None:
        """Rewrite each sample for the mode (in place) and record its statistics; a sample whose
        turns' versions are unknown, or no longer kept, is left as TRL made it (counted)."""
        t0 = time.perf_counter()
        ids = [np.asarray(s.input_ids) for s in samples]
        versions = [position_versions(len(i), self.turns_fn([int(t) for t in i])) for i in ids]
        masks = [
            np.asarray(s.completion_mask).astype(bool) & (v >= 0)
            for s, v in zip(samples, versions, strict=True)
        ]
        missing: dict[int, str] = {}  # versions not kept, or refused: their samples stay as made
        candidates = [i for i, m in enumerate(masks) if m.any()]
        scored = self.policy.log_probs_many(
            [(ids[i], np.where(masks[i], versions[i], -1)) for i in candidates], missing
        )
        for v, why in sorted(missing.items()):
            log.warning("samples of version %d left uncorrected: %s", v, why)
        for i in candidates:
            if np.isin(versions[i][masks[i]], list(missing)).any():
                masks[i][:] = False
        todo = [i for i in candidates if masks[i].any()]
        gens = [scored[candidates.index(i)] for i in todo]
        # the current policy: every sample for tis's ratio, else every drift_every-th (statistics)
        scored = [
            j
            for j, _ in enumerate(todo)
            if self.loss.mode == "tis" or (self._seen + j) % self.drift_every == 0
        ]
        self._seen += len(todo)
        currents = {}
        if scored:
            lps = self.current_fn([ids[todo[j]] for j in scored], [masks[todo[j]] for j in scored])
            currents = dict(zip(scored, lps, strict=True))
        newest = self.newest_fn()
        seconds = (time.perf_counter() - t0) / len(samples)
        for _ in range(len(samples) - len(todo)):
            self._record(uncorrected=1, seconds=seconds)
        for j, i in enumerate(todo):
            sample, mask, gen = samples[i], masks[i], gens[j]
            sampled = np.asarray(sample.old_log_probs, dtype=np.float32)
            log_mismatch = float(np.mean(gen[mask] - sampled[mask]))
            weight = min(math.exp(log_mismatch), self.loss.cap)
            lags = (newest - versions[i][mask]) if newest is not None else np.zeros(int(mask.sum()))
            drift = k3(currents[j][mask] - gen[mask]) if j in currents else None
            self._record(
                weight=weight,
                truncated=float(math.exp(log_mismatch) > self.loss.cap),
                mismatch_max=float(np.exp(np.max(gen[mask] - sampled[mask]))),
                kl_mismatch=float(np.mean(k3(gen[mask] - sampled[mask]))),
                lag_mean=float(np.mean(lags)),
                drift_by_lag={}
                if drift is None
                else {
                    int(k): (float(drift[lags == k].sum()), int((lags == k).sum()))
                    for k in np.unique(lags)
                },
                seconds=seconds,
            )
            if self.loss.mode == "off":  # statistics only (``off_policy_stats``)
                continue
            # decoupled: the ratio against the generating policy; tis: against the current one
            new_old = gen if self.loss.mode == "decoupled" else currents[j]
            sample.old_log_probs = np.where(mask, new_old, sampled).astype(sampled.dtype)
            sample.advantage = float(sample.advantage) * weight

    def _record(self, **row) -> None:
        with self._lock:
            self._stats.append(row)

    def take_stats(self) -> dict[str, float]:
        """The statistics since the last call (one step's samples): ``offpolicy/weight_mean``,
        ``weight_min``, ``truncated`` (share of samples capped), ``mismatch_max`` (largest token
        ratio pi_gen / pi_vLLM), ``kl_mismatch`` (k3 of pi_vLLM -> pi_gen per token), ``lag_mean``
        (versions), per version lag k ``kl_drift_lag{k}`` (k3 of pi_gen -> pi_theta per token, on
        the ``tokens_lag{k}`` tokens generated k versions before the newest), ``uncorrected``
        (samples left as TRL made them) and ``seconds`` (the recomputation's time)."""
        with self._lock:
            rows, self._stats = self._stats, []
        done = [r for r in rows if "weight" in r]
        out = {
            "offpolicy/uncorrected": float(sum(r.get("uncorrected", 0) for r in rows)),
            "offpolicy/seconds": round(sum(r["seconds"] for r in rows), 3),
        }
        if done:
            out.update(
                {
                    "offpolicy/weight_mean": float(np.mean([r["weight"] for r in done])),
                    "offpolicy/weight_min": float(np.min([r["weight"] for r in done])),
                    "offpolicy/truncated": float(np.mean([r["truncated"] for r in done])),
                    "offpolicy/mismatch_max": float(np.max([r["mismatch_max"] for r in done])),
                    "offpolicy/kl_mismatch": float(np.mean([r["kl_mismatch"] for r in done])),
                    "offpolicy/lag_mean": float(np.mean([r["lag_mean"] for r in done])),
                }
            )
            by_lag: dict[int, list[float]] = {}
            for r in done:
                for lag, (total, count) in r["drift_by_lag"].items():
                    acc = by_lag.setdefault(lag, [0.0, 0])
                    acc[0], acc[1] = acc[0] + total, acc[1] + count
            for lag, (total, count) in sorted(by_lag.items()):
                out[f"offpolicy/kl_drift_lag{lag}"] = total / count
                out[f"offpolicy/tokens_lag{lag}"] = float(count)
        return out

    def __getattr__(self, name):  # put_nowait, qsize, ... unchanged
        return getattr(self._inner, name)


class CorrectionStats(TrainerCallback):
    """Adds the correction's statistics of each step to TRL's logs (the step line,
    ``steps.jsonl``)."""

    def __init__(self, correction: OffPolicyCorrection):
        self.correction = correction

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs.update(self.correction.take_stats())


def correction_for(trainer, grpo, model_path: str, publisher, turns_fn) -> OffPolicyCorrection:
    """The run's :class:`OffPolicyCorrection` around ``trainer.rollout_queue``: a history that
    follows the publisher's bucket keeping ``max_staleness`` versions, models of
    ``model_path``'s architecture on the trainer model's device, the trainer's own model for
    ``tis``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltasync.subscriber import DeltaSubscriber

    history = VersionHistory(DeltaSubscriber(publisher.store), keep=grpo.max_staleness)
    config = AutoConfig.from_pretrained(model_path)
    model = trainer.accelerator.unwrap_model(trainer.model)
    device = next(model.parameters()).device  # the versions' models run where training does
    policy = GeneratingPolicy(
        lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device), history
    )

    def newest() -> int | None:
        return publisher.newest_published

    loss = OffPolicyLoss(grpo.off_policy, cap=grpo.tis_cap)
    return OffPolicyCorrection(
        trainer.rollout_queue, loss, policy, turns_fn, current_policy_fn(model), newest
    )


def current_policy_fn(model) -> Callable:
    """``f(sequences, wanted) -> batch_log_probs(model, sequences, wanted)`` for the model being
    trained.

    TRL's AsyncGRPO trainer sets the model's attention to its packed tree attention
    (``trl.experimental.async_grpo.packing.TREE_ATTENTION``), which needs the packing's index
    arguments that a plain forward does not pass; ``f`` runs the forward with PyTorch's SDPA and
    in eval mode, and puts back the attention and the training mode after it. It runs in the
    thread that iterates TRL's dataset, between the steps' forwards, never beside one."""

    def current(sequences: list[np.ndarray], wanted: list[np.ndarray]) -> list[np.ndarray]:
        attention, training = model.config._attn_implementation, model.training
        model.set_attn_implementation("sdpa")
        model.eval()
        try:
            return batch_log_probs(model, sequences, wanted)
        finally:
            model.set_attn_implementation(attention)
            model.train(training)

    return current
