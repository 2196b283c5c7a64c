"""`arith`: data-free, single-turn arithmetic ("What is 3 + 5?"), the default task.

SmolLM2-135M-Instruct scores about 0.08 on it (bench/RESULTS.md: it rarely answers with just the
number) and GRPO lifts it to about 0.9 in 40 steps: hard enough to learn, easy enough
to move.

Held out: a problem is (op, a, b) with the operands sorted, since all three ops are
commutative; it belongs to exactly one split by sha256 of "op:lo:hi"
(`splits.split_of_key`), so split "test" asks only problems that training never shows.
About 20% of problems are "test": with the default 1-digit operands only 8 of the 55
unordered pairs for add (15 for mul, 8 for max), too few for 200; `digits=2` gives 757
of 4,095 (772 mul, 800 max).
"""

from __future__ import annotations

from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.envs.answers import first_number, same_number
from opentinker.services.envhost.envs.splits import SPLITS, split_of_key

OPS = ("add", "mul", "max")


def split_of(op: str, a: int, b: int) -> str:
    """Which split the problem (op, a, b) belongs to: "test" for ~20% of
    problems, by sha256 of "op:lo:hi" (`splits.split_of_key`)."""
    lo, hi = sorted((a, b))
    return split_of_key(f"{op}:{lo}:{hi}")


def answer_of(op: str, a: int, b: int) -> int:
    return {"add": a + b, "mul": a * b, "max": max(a, b)}[op]


def question_of(op: str, a: int, b: int) -> str:
    if op == "max":
        return f"Which number is larger, {a} or {b}? Reply with only the number."
    sign = "+" if op == "add" else "*"
    return f"What is {a} {sign} {b}? Reply with only the number."


class ArithGame(AbstractGame):
    """One arithmetic question; reward 1.0 iff the first number in the reply is the answer.

    env_args:
      op:       "add" (default), "mul" or "max" (the larger of the two)
      digits:   digits of the first operand, 1..9 (default 1: 0..9)
      digits_b: digits of the second operand (default: `digits`)

    Raises ValueError (naming the arg) for a bad op or digit count, and TypeError for
    an unknown env_arg, so a typo in a job spec fails the episode instead of training
    on a task nobody asked for.
    """

    name = "arith"

    def __init__(self, op: str = "add", digits: int = 1, digits_b: int | None = None):
        super().__init__(op=op, digits=digits, digits_b=digits_b)
        if op not in OPS:
            raise ValueError(f"env_args.op: {op!r} is not one of {OPS}")
        for field, d in (("digits", digits), ("digits_b", digits if digits_b is None else digits_b)):
            if not isinstance(d, int) or not 1 <= d <= 9:
                raise ValueError(f"env_args.{field}: must be an integer in 1..9, got {d!r}")
        self.op = op
        self.ranges = (_range(digits), _range(digits if digits_b is None else digits_b))
        self.a = self.b = 0

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """Operands {"a", "b"} for `seed`, drawn only from problems of `split`."""
        if split not in SPLITS:
            raise ValueError(f"split: {split!r} is not one of {SPLITS}")
        rng = self.rng(f"arith:{split}:{seed}")
        # Rejection sampling: ~1.25 draws for train, ~5 for test. Bounded, because a
        # tiny operand range could in principle hold no problem of a split.
        for _ in range(1000):
            a, b = rng.randint(*self.ranges[0]), rng.randint(*self.ranges[1])
            if split_of(self.op, a, b) == split:
                return {"a": a, "b": b}
        raise ValueError(f"split: no {split!r} problem in the operand ranges {self.ranges}")

    def reset(self, a: int | None = None, b: int | None = None, seed: int | None = None) -> str:
        """Start on operands `a`, `b` (or draw them from `seed`). Returns ""; the
        question is the initial user message."""
        if a is None or b is None:
            state = self.generate_initial_state(seed or 0)
            a, b = state["a"], state["b"]
        self.a, self.b = int(a), int(b)
        return ""

    @property
    def answer(self) -> int:
        return answer_of(self.op, self.a, self.b)

    def get_system_prompt(self) -> str:
        return "You are a precise calculator. Reply with only the number, nothing else."

    def get_initial_user_message(self) -> str:
        return question_of(self.op, self.a, self.b)

    def get_privileged_context(self) -> str:
        """The answer, for a distillation teacher (JobSpec teacher_context)."""
        return f"The answer is {self.answer}."

    def step(self, action: str) -> StepResult:
        got = first_number(action)
        correct = same_number(got, self.answer)
        return StepResult(observation="", reward=1.0 if correct else 0.0, done=True,
                          info={"answer": self.answer, "parsed": got, "correct": correct})


def _range(digits: int) -> tuple[int, int]:
    return (0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
