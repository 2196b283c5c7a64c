"""Held-out splits for generated problems: split "test" asks only problems that split
"train" never shows.

A problem is the part of an env's initial state that decides the episode (arith's
operands, bandit's arm probabilities, a gomoku opening), written by the env as a
canonical string key. Every problem belongs to exactly one split, chosen by sha256 of
its key, so the choice is the same in every process, machine and Python version
(Python's own `hash` of a str is salted per process). An env draws a problem from the
seed's generator, and draws again until the problem is of the asked split.

Two rules, by the number N of problems an env's configuration can pose:

- `split_of_key` (N large, or not listed): "test" when the hash falls in the first
  TEST_PERCENT of 100 buckets, so about a fifth of all problems. arith's rule.
- `HeldOut` (N small enough to list, at most ENUMERATE_MAX): exactly `held_out_count(N)`
  problems, those of lowest hash, are "test", so a small space gets a known count
  instead of a chance one (16 problems at 20% each could give 0 or 8).
  `held_out_count` is a fifth, rounded down, raised to MIN_TEST where a third of the space
  holds that many (600 <= N < 1000). Under 5 problems a fifth is none: such a space
  cannot hold one out, and its "test" split asks the train problems (each env's
  docstring says when that happens).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")

SPLITS = ("train", "test")
TEST_PERCENT = 20
#: test problems a mid-sized space is raised to (evaluation on fewer is noisy: at 200,
#: a success rate near 0.5 has a standard error of about 0.035)
MIN_TEST = 200
#: the largest space listed in full for `HeldOut` (hashing it takes about 10 ms)
ENUMERATE_MAX = 10_000
#: draws before giving up on a split; ~5 are needed for "test" on average
MAX_DRAWS = 1000


def key_hash(key: str) -> int:
    """The first 4 bytes of sha256(`key`), as an unsigned big-endian integer."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")


def split_of_key(key: str) -> str:
    """The split of the problem with canonical `key`: "test" for about TEST_PERCENT%
    of keys (the hash modulo 100 below TEST_PERCENT), else "train"."""
    return "test" if key_hash(key) % 100 < TEST_PERCENT else "train"


def held_out_count(n: int) -> int:
    """How many of `n` listed problems `HeldOut` puts in "test": n // 5, raised to
    MIN_TEST when n >= 3 * MIN_TEST, so train keeps at least two thirds."""
    k = n * TEST_PERCENT // 100
    return max(k, MIN_TEST) if n >= 3 * MIN_TEST else k


def check_split(split: str) -> None:
    """Raises ValueError naming `split` when it is not "train" or "test"."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {SPLITS}")


def draw(rng: Any, make: Callable[[Any], T], key: Callable[[T], str], split: str,
         split_of: Callable[[str], str] = split_of_key) -> T:
    """A problem of `split`: `make(rng)` until `split_of(key(problem)) == split`.

    Raises ValueError for an unknown split, or when MAX_DRAWS draws found none of it
    (a space too small to hold a problem of that split).
    """
    check_split(split)
    for _ in range(MAX_DRAWS):
        problem = make(rng)
        if split_of(key(problem)) == split:
            return problem
    raise ValueError(f"split: no {split!r} problem in {MAX_DRAWS} draws")


class HeldOut:
    """The split of each problem of a space listed in full (at most ENUMERATE_MAX).

    test: the `held_out_count(size)` keys of lowest `key_hash` (ties by key), a frozenset.
    """

    def __init__(self, keys: Iterable[str]):
        ranked = sorted(set(keys), key=lambda k: (key_hash(k), k))
        self.size = len(ranked)
        self.test = frozenset(ranked[:held_out_count(self.size)])

    def split_of(self, key: str) -> str:
        return "test" if key in self.test else "train"

    def draw(self, rng: Any, make: Callable[[Any], T], key: Callable[[T], str], split: str) -> T:
        """As module `draw`; where nothing is held out (size < 5) "test" asks train's problems."""
        check_split(split)
        return draw(rng, make, key, split if self.test else "train", self.split_of)
