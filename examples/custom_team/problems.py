"""A problem source for `kind: callable`: random word lists, generated instead of read.

flexmarl calls `make_problems(**workload.params.kwargs)` once per process and splits the
result into train / held-out (a `split` key pins an item; otherwise a hash of its text
decides). Items are dicts with `input`, `answer` and optionally `id`, `split`, `meta`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

VOCAB = ("ant", "bee", "cow", "doe", "eel", "fox", "gnu", "hen", "owl", "yak", "elk", "emu")


def make_problems(n: int = 200, max_words: int = 4, seed: int = 0) -> Iterator[dict[str, str]]:
    """`n` word lists of 2..max_words words with their reversals; same seed, same list."""
    rng = random.Random(seed)
    for i in range(n):
        words = rng.sample(VOCAB, rng.randint(2, max_words))
        yield {"id": f"z{i}", "input": " ".join(words), "answer": " ".join(reversed(words))}
