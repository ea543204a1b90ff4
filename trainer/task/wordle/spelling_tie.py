"""GRPO that moves the local model's answer rows only along their spelling.

The local model has one token per Wordle answer (``trainer.task.wordle.model``): its input and
output rows start from shared letter-at-position vectors (``spelling_init``) and the warm start
trains them freely. A policy gradient on the training words then moves the rows of the words it
played, which no held-out word shares (measured: training reward up, held-out flat; docs/
BENCHMARKS.md section 6 (the main job)). :class:`SpellingTiedRows` keeps what GRPO changes in those
rows a function of spelling: after each optimizer step the change of the answer rows since GRPO
began, ``D`` (answers x hidden), is replaced by its projection onto the span of the spelling
features ``S`` (answers x 156: a one-hot letter at each of the 5 positions, 130 columns, and one per
distinct letter, 26, the same parts as ``spelling_init``):

    W_answers <- W0 + U U^T (W_answers - W0),   U = orthonormal basis of S's columns (SVD)

so a step that raises "crane" after some board raises every word with c at 1, r at 2, ... in the
same way, held-out words included. The rest of the model trains as usual. It runs in a
``TrainerCallback.on_optimizer_step`` (after ``optimizer.step()``, before TRL's weight sync in
``on_step_end``), so every published version already holds the projected rows.
"""

from __future__ import annotations

from transformers import TrainerCallback

from trainer.task.wordle.spelling import AnswerRowSpan, SpellingTieError, spelling_features

__all__ = ["SpellingTieError", "SpellingTiedRows", "spelling_features"]


class SpellingTiedRows(TrainerCallback):
    """Project the GRPO change of the answer rows (input and output embeddings) onto their
    spelling features after every optimizer step (see the module docstring and
    ``trainer.task.wordle.spelling.AnswerRowSpan``).

    Args:
        model: the trainer's ``Qwen3ForCausalLM`` (untied: input and output rows are separate).
        tokenizer: its tokenizer, with every answer as one token.

    Raises:
        SpellingTieError: an answer is not a single token of ``tokenizer``.
    """

    def __init__(self, model, tokenizer):
        self.span = AnswerRowSpan(model, tokenizer)

    def on_train_begin(self, args, state, control, **kwargs):
        self.span.anchor()  # on the trainer's device (a GPU run holds the weights there)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.span.project()
