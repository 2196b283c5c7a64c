"""`guess-number`: data-free, multi-turn. The model guesses a hidden integer and is
told "higher" or "lower" after each guess; it proves the agent loop end to end.

Held out: a problem is the hidden number with its range (n, target), n problems in
all. Up to ENUMERATE_MAX they are listed and `splits.HeldOut` makes exactly
`held_out_count(n)` targets "test": with the default n = 16 only 3 (2, 3 and 12),
as 16 problems cannot give 200; n = 1000 gives 200, and n < 5 none (the test split
then asks the train targets). Above ENUMERATE_MAX a target's split is
`splits.split_of_key`, about a fifth of them "test".
"""

from __future__ import annotations

import functools
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.envs.answers import first_number
from opentinker.services.envhost.envs.splits import ENUMERATE_MAX, HeldOut, check_split, draw, split_of_key


def problem_key(n: int, target: int) -> str:
    """The canonical key of the problem: hidden `target` in 1..`n`."""
    return f"guess-number:{n}:{target}"


@functools.lru_cache(maxsize=64)
def held_out(n: int) -> HeldOut | None:
    """The split of each target in 1..`n`, or None above ENUMERATE_MAX (then by hash)."""
    return HeldOut(problem_key(n, t) for t in range(1, n + 1)) if n <= ENUMERATE_MAX else None


def split_of(n: int, target: int) -> str:
    """Which split the problem (n, target) belongs to; "train" for every target when
    n < 5 (nothing is held out)."""
    held = held_out(n)
    return held.split_of(problem_key(n, target)) if held else split_of_key(problem_key(n, target))


class GuessNumberGame(AbstractGame):
    """Find a hidden integer in [1, n] within `max_turns` guesses.

    Each turn the observation says "Higher." (the number is larger than the guess),
    "Lower." or "Not a number."; reward 1.0 on the turn the guess is right (done),
    0.0 otherwise; the episode ends after `max_turns` guesses.

    env_args:
      n:         the largest possible number (default 16, at least 2)
      max_turns: guesses allowed (default 6; log2(16) = 4 suffice with binary search)
    """

    name = "guess-number"

    def __init__(self, n: int = 16, max_turns: int = 6):
        super().__init__(n=n, max_turns=max_turns)
        if not isinstance(n, int) or n < 2:
            raise ValueError(f"env_args.n: must be an integer >= 2, got {n!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"env_args.max_turns: must be an integer >= 1, got {max_turns!r}")
        self.n, self.max_turns = n, max_turns
        self.target, self.turn = 0, 0

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"target"}: a hidden number of `split` (module docstring), drawn from `seed`.
        Raises ValueError for a split other than "train" or "test"."""
        check_split(split)
        held = held_out(self.n)
        pick = held.draw if held else draw
        return {"target": pick(self.rng(f"guess:{split}:{seed}"), lambda r: r.randint(1, self.n),
                               lambda t: problem_key(self.n, t), split)}

    def reset(self, target: int | None = None, seed: int | None = None) -> str:
        if target is None:
            target = self.generate_initial_state(seed or 0)["target"]
        if not 1 <= int(target) <= self.n:
            raise ValueError(f"target: {target} is outside 1..{self.n}")
        self.target, self.turn = int(target), 0
        return ""

    def get_system_prompt(self) -> str:
        return "You are playing a number guessing game. Reply with only your guess, a single integer."

    def get_initial_user_message(self) -> str:
        return (f"I am thinking of an integer between 1 and {self.n}. Guess it. After each guess "
                f"I will say 'Higher.' or 'Lower.'. You have {self.max_turns} guesses. "
                "Reply with only your guess.")

    def step(self, action: str) -> StepResult:
        self.turn += 1
        left = self.max_turns - self.turn
        got = first_number(action)
        info: dict[str, Any] = {"turn": self.turn, "guess": got}
        if got is not None and got == self.target:
            return StepResult("Correct!", 1.0, True, {**info, "target": self.target, "solved": True})
        if left <= 0:
            return StepResult(f"Out of guesses. The number was {self.target}.", 0.0, True,
                              {**info, "target": self.target, "solved": False})
        if got is None:
            hint = f"Not a number. Reply with only an integer between 1 and {self.n}."
        elif got < self.target:
            hint = f"Higher. The number is greater than {got:g}."
        else:
            hint = f"Lower. The number is less than {got:g}."
        return StepResult(f"{hint} {left} guess{'es' if left > 1 else ''} left.", 0.0, False, info)
