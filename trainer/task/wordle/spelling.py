"""Answer rows that are a function of spelling: the features and the projection onto their span.

The local model has one token per Wordle answer (``trainer.task.wordle.model``). Its answer rows
(input and output embeddings) start as sums of letter-at-position and letter vectors
(``trainer.task.wordle.model.spelling_init``), i.e. inside the span of the spelling features ``S``
(answers x 156: a one-hot letter at each of the 5 positions, 130 columns, and one per distinct
letter, 26; rank 147). :class:`AnswerRowSpan` projects rows back onto that span,

    W_answers <- W0 + U U^T (W_answers - W0),   U = orthonormal basis of S's columns (SVD),

so what training changes in a word's row is shared with every word spelled alike: GRPO
(``trainer.task.wordle.spelling_tie``, ``--tie-answer-rows``) then learns nothing that belongs to
one training word alone, and held-out words get what training words get. Measured:
with free rows the default warm start wins 0.47 of games on training words and 0.31 on held-out
words (docs/BENCHMARKS.md section 6 (the main job), "Training words and held-out words").
torch is imported inside the functions.
"""

from __future__ import annotations

from trainer.task.wordle import board
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


class AnswerRowSpan:
    """The answer rows of a model's input and output embeddings, held to their spelling span.

    Args:
        model: a ``Qwen3ForCausalLM`` with untied input and output embeddings.
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

    def anchor(self) -> None:
        """Take the rows as they are now as ``W0`` (on the weights' device)."""
        device = self.weights[0].device
        self.ids, self.basis = self.ids.to(device), self.basis.to(device)
        self.start = [w.detach()[self.ids].clone() for w in self.weights]

    def project(self) -> None:
        """Replace the change of the answer rows since :meth:`anchor` by its projection onto the
        spelling span (in place, without autograd; 2 x 2 x answers x rank x hidden FLOPs).

        Raises:
            RuntimeError: :meth:`anchor` was not called first.
        """
        import torch

        if self.start is None:
            raise RuntimeError("AnswerRowSpan.project() before anchor(): call anchor() first")
        with torch.no_grad():
            for w, w0 in zip(self.weights, self.start, strict=True):
                d = w[self.ids] - w0
                w[self.ids] = w0 + self.basis @ (self.basis.T @ d)
