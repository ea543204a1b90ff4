"""Episode stickiness and per-sample versions, from the token prefixes of TRL's requests.

The turns of one multi-turn episode go to the replica that served its last turn, whose prefix
cache holds the episode's tokens so far; and a finished sample is tagged with the oldest bucket
version that generated any of its turns (each answer's ``X-Deltasync-Version``).

TRL's requests carry no episode id, but its multi-turn prompts are prefix-preserving token lists:
a turn's prompt is the previous turn's prompt, that turn's completion, then the tool's reply. So
after each answer the router remembers ``(length, hash)`` of ``prompt + completion`` with the
replica that answered, and for a new request it hashes every prefix of its prompt once (a
polynomial rolling hash) and looks up each remembered length, longest first. Episodes of a GRPO
group share their first prompt and are told apart by their completions. Entries are forgotten
oldest first beyond ``max_entries``; a miss routes by load as usual. A sample's token ids
(prompt and every turn) start with each of its turns' ``prompt + completion``, so the same
lookup finds the versions of all its turns.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

_MOD = (1 << 61) - 1  # a Mersenne prime: the rolling hash's modulus
_BASE = 1_000_003


def prefix_hashes(tokens: list[int]) -> list[int]:
    """``h[i]``: the rolling hash of ``tokens[:i]``, for i = 0..len(tokens)."""
    out, h = [0], 0
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
        out.append(h)
    return out


class EpisodeAffinity:
    """Which replica answered each episode's latest turn.

    Args:
        max_entries: turns remembered (oldest dropped first).
    """

    def __init__(self, max_entries: int = 50_000):
        self.max_entries = max_entries
        # (length, hash) -> (replica url, bucket version that answered, or None)
        self._replica: OrderedDict[tuple[int, int], tuple[str, int | None]] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # remembered sequence lengths, with counts
        self._lock = threading.Lock()
        self.hits = 0  # requests the router sent to their episode's replica

    def replica_for(self, prompt: list[int]) -> str | None:
        """The replica of the longest remembered turn that ``prompt`` continues, or None."""
        with self._lock:
            lengths = sorted((n for n in self._lengths if n < len(prompt)), reverse=True)
        if not lengths:
            return None
        h = prefix_hashes(prompt[: lengths[0]])
        with self._lock:
            for n in lengths:
                hit = self._replica.get((n, h[n]))
                if hit is not None:
                    return hit[0]
        return None

    def versions_of(self, tokens: list[int]) -> list[int]:
        """The bucket versions that answered the turns ``tokens`` holds (a finished sample's
        token ids: every turn's prompt + completion is a prefix of them); [] when none is
        remembered."""
        with self._lock:
            lengths = [n for n in self._lengths if n <= len(tokens)]
        if not lengths:
            return []
        h = prefix_hashes(tokens[: max(lengths)])
        with self._lock:
            hits = [self._replica.get((n, h[n])) for n in lengths]
        return [v for _, v in filter(None, hits) if v is not None]

    def turn_versions(self, tokens: list[int]) -> list[tuple[int, int]]:
        """``(end, version)`` of each remembered turn of the sample ``tokens``, in order: the
        turn's ``prompt + completion`` is ``tokens[:end]``, and ``version`` answered it (turns
        whose version is unknown are left out)."""
        with self._lock:
            lengths = sorted(n for n in self._lengths if n <= len(tokens))
        if not lengths:
            return []
        h = prefix_hashes(tokens[: lengths[-1]])
        with self._lock:
            hits = [(n, self._replica.get((n, h[n]))) for n in lengths]
        return [(n, hit[1]) for n, hit in hits if hit is not None and hit[1] is not None]

    def remember(
        self, prompt: list[int], completion: list[int], url: str, version: int | None = None
    ) -> None:
        """Record an answer: ``prompt`` and ``completion`` token ids, the replica that gave it
        and the bucket version it reported; the episode's next turn will start with both."""
        seq = prompt + completion
        key = (len(seq), prefix_hashes(seq)[-1])
        with self._lock:
            if key not in self._replica:
                self._lengths[key[0]] += 1
            self._replica[key] = (url, version)
            self._replica.move_to_end(key)
            while len(self._replica) > self.max_entries:
                (n, _), _ = self._replica.popitem(last=False)
                self._lengths[n] -= 1
                if not self._lengths[n]:
                    del self._lengths[n]
