"""GRPO that moves the local model's answer rows only along their spelling.

The local model has one token per Wordle answer (``trainer.task.wordle_model``): its input and
output rows start from shared letter-at-position vectors (``spelling_init``) and the warm start
trains them freely. A policy gradient on the training words then moves the rows of the words it
played, which no held-out word shares (measured: training reward up, held-out flat; docs/
BENCHMARKS.md section 6). :class:`SpellingTiedRows` keeps what GRPO changes in those rows a function
of spelling: after each optimizer step the change of the answer rows since GRPO began, ``D``
(answers x hidden), is replaced by its projection onto the span of the spelling features ``S``
(answers x 156: a one-hot letter at each of the 5 positions, 130 columns, and one per distinct
letter, 26, the same parts as ``spelling_init``):

    W_answers <- W0 + U U^T (W_answers - W0),   U = orthonormal basis of S's columns (SVD)

so a step that raises "crane" after some board raises every word with c at 1, r at 2, ... in the
same way, held-out words included. The rest of the model trains as usual. It runs in a
``TrainerCallback.on_optimizer_step`` (after ``optimizer.step()``, before TRL's weight sync in
``on_step_end``), so every published version already holds the projected rows.
"""

from __future__ import annotations

from transformers import TrainerCallback

from trainer.task import board
from wordle_env import wordlists


class SpellingTieError(ValueError):
    """The model's tokenizer does not hold the Wordle answers as single tokens (only the local
    ``tiny`` model does), so its answer rows cannot be tied to spelling."""


def spelling_features(words: list[str]):
    """The spelling features of ``words``: float32 tensor (len(words), 156), a one-hot letter at
    each of the 5 positions (column ``26 * position + letter``) and one per distinct letter
    (column ``130 + letter``)."""
    import torch

    idx = {c: i for i, c in enumerate(board.LETTERS)}
    n_pos, n_letters = board.WORD_LENGTH, len(board.LETTERS)
    s = torch.zeros(len(words), n_pos * n_letters + n_letters)
    for row, word in enumerate(words):
        for pos, c in enumerate(word):
            s[row, pos * n_letters + idx[c]] = 1.0
        for c in set(word):
            s[row, n_pos * n_letters + idx[c]] = 1.0
    return s


class SpellingTiedRows(TrainerCallback):
    """Project the GRPO change of the answer rows (input and output embeddings) onto their
    spelling features after every optimizer step (see the module docstring).

    Args:
        model: the trainer's ``Qwen3ForCausalLM`` (untied: input and output rows are separate).
        tokenizer: its tokenizer, with every answer as one token.

    Raises:
        SpellingTieError: an answer is not a single token of ``tokenizer``.
    """

    def __init__(self, model, tokenizer):
        import torch

        words = list(wordlists.answers())
        ids = tokenizer.convert_tokens_to_ids(words)
        unk = tokenizer.unk_token_id
        missing = [w for w, i in zip(words, ids, strict=True) if i is None or i == unk]
        if missing:
            raise SpellingTieError(
                f"expected every Wordle answer as one token of the model's tokenizer (the local "
                f"model's), found {len(missing)} that are not (e.g. {missing[0]!r}); tie answer "
                "rows to spelling only with the local model (--model tiny)"
            )
        self.ids = torch.tensor(ids)
        u, sv, _ = torch.linalg.svd(spelling_features(words).double(), full_matrices=False)
        self.basis = u[:, sv > sv[0] * 1e-6].float()  # (answers, rank): orthonormal columns
        self.weights = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        device = self.weights[0].device  # the trainer's (a GPU run holds the weights there)
        self.ids, self.basis = self.ids.to(device), self.basis.to(device)
        self.start = [w.detach()[self.ids].clone() for w in self.weights]

    def on_optimizer_step(self, args, state, control, **kwargs):
        import torch

        with torch.no_grad():
            for w, w0 in zip(self.weights, self.start, strict=True):
                d = w[self.ids] - w0
                w[self.ids] = w0 + self.basis @ (self.basis.T @ d)
