"""`bandit`: data-free, single-turn multi-armed bandit. The model picks one of n arms,
numbered 1..n, and is paid by that arm's hidden probability.

The smallest RL task there is: with fixed `probs` (e.g. [0.1, 0.9]) a policy can only
find the best arm from rewards, which makes it a check that a training loop learns at
all; with `show_probs` the probabilities are in the prompt and the task is reading
them and choosing the largest.

Held out: a problem is the arms' probabilities in arm order (2 decimals each, so
101**arms problems: 104 million with the default 4 arms). A drawn set belongs to one
split by `splits.split_of_key` of its key, about a fifth "test", and a seed draws
again until its set is of the asked split. With fixed `probs` there is one problem
and nothing to hold out: both splits ask it.
"""

from __future__ import annotations

import random
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.envs.answers import first_number
from opentinker.services.envhost.envs.splits import check_split, draw, split_of_key

REWARD_MODES = ("sample", "expected")
# Reward draws differ between the episodes of a group (which share one state), so
# they come from the OS, not from the state's seed; one instance serves every thread.
_draws = random.SystemRandom()


class BanditGame(AbstractGame):
    """Choose an arm 1..n; the reward is a Bernoulli draw with the arm's probability.

    reward_mode="sample" pays 1.0 with the chosen arm's probability, else 0.0: the
    bandit proper, and episodes of a GRPO group can differ on the same arm.
    reward_mode="expected" pays the probability itself: deterministic, lower variance.
    A reply without an arm number in 1..n gets 0.0.

    env_args:
      arms:        number of arms, 2..26 (default 4; with `probs`, its length)
      probs:       fixed arm probabilities, each in [0, 1] (default: drawn per seed,
                   uniform and rounded to 2 decimals, so a group shares them)
      reward_mode: "sample" (default) or "expected"
      show_probs:  list the probabilities in the prompt (default False)

    info: valid (an arm in 1..n was read), chosen (arm number or None), prob (its
    probability or None), best (the best arm, the first on ties), best_prob, regret
    (best_prob minus the chosen arm's probability, to 6 places; best_prob when none
    was chosen), and error on an invalid reply.

    Raises ValueError naming the env_arg for a bad value, TypeError for an unknown one.
    """

    name = "bandit"

    def __init__(self, arms: int | None = None, probs: list[float] | None = None,
                 reward_mode: str = "sample", show_probs: bool = False):
        super().__init__(arms=arms, probs=probs, reward_mode=reward_mode, show_probs=show_probs)
        if probs is not None:
            probs = _checked_probs(probs, "env_args.probs")
            if arms is not None and arms != len(probs):
                raise ValueError(f"env_args.arms: {arms!r} but env_args.probs has {len(probs)}")
            arms = len(probs)
        arms = 4 if arms is None else arms
        if isinstance(arms, bool) or not isinstance(arms, int) or not 2 <= arms <= 26:
            raise ValueError(f"env_args.arms: must be an integer in 2..26, got {arms!r}")
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"env_args.reward_mode: {reward_mode!r} is not one of {REWARD_MODES}")
        if show_probs is not True and show_probs is not False:
            raise ValueError(f"env_args.show_probs: must be true or false, got {show_probs!r}")
        self.arms, self.fixed, self.mode, self.show = arms, probs, reward_mode, show_probs
        self.probs: list[float] = []

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"probs"}: the fixed probabilities, or `arms` of them drawn from `seed`, a
        set of `split` (module docstring). Raises ValueError for a split other than
        "train" or "test"."""
        check_split(split)
        if self.fixed is not None:
            return {"probs": list(self.fixed)}
        return {"probs": draw(self.rng(f"bandit:{split}:{seed}"),
                              lambda r: [round(r.random(), 2) for _ in range(self.arms)], problem_key, split)}

    def reset(self, probs: list[float] | None = None, seed: int | None = None) -> str:
        """Start with arm probabilities `probs` (or those drawn from `seed`). Returns "".

        Raises ValueError naming `probs` when they do not fit the env's arms.
        """
        if probs is None:
            probs = self.generate_initial_state(seed or 0)["probs"]
        probs = _checked_probs(probs, "probs")
        if len(probs) != self.arms:
            raise ValueError(f"probs: {len(probs)} probabilities for {self.arms} arms")
        self.probs = probs
        return ""

    def get_system_prompt(self) -> str:
        return ("You are choosing between slot machines (arms). Each arm pays 1 point with its "
                "own fixed probability and 0 otherwise. Reply with only the number of the arm "
                "you pull.")

    def get_initial_user_message(self) -> str:
        if self.show:
            table = "\n".join(f"Arm {i}: pays with probability {p:.2f}"
                              for i, p in enumerate(self.probs, 1))
            return f"{table}\nWhich arm do you pull (1-{self.arms})? Reply with only its number."
        return (f"There are {self.arms} arms, numbered 1 to {self.arms}. Which arm do you pull? "
                "Reply with only its number.")

    def step(self, action: str) -> StepResult:
        best_prob = max(self.probs)
        best = self.probs.index(best_prob) + 1
        info: dict[str, Any] = {"best": best, "best_prob": best_prob}
        got = first_number(action)
        if got is None or got != int(got) or not 1 <= got <= self.arms:
            error = ("no arm number in the reply" if got is None
                     else f"{got:g} is not an arm number in 1..{self.arms}")
            return StepResult("", 0.0, True, {**info, "valid": False, "chosen": None, "prob": None,
                                              "regret": best_prob, "error": error})
        arm = int(got)
        p = self.probs[arm - 1]
        reward = p if self.mode == "expected" else float(_draws.random() < p)
        return StepResult("", reward, True, {**info, "valid": True, "chosen": arm, "prob": p,
                                             "regret": round(best_prob - p, 6)})


def problem_key(probs: list[float]) -> str:
    """The canonical key of a problem: its probabilities in arm order, to 2 decimals."""
    return "bandit:" + ",".join(f"{p:.2f}" for p in probs)


def split_of(probs: list[float]) -> str:
    """Which split drawn probabilities `probs` belong to (`splits.split_of_key`)."""
    return split_of_key(problem_key(probs))


def _checked_probs(probs: Any, field: str) -> list[float]:
    if (not isinstance(probs, (list, tuple)) or not 2 <= len(probs) <= 26
            or not all(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1
                       for p in probs)):
        raise ValueError(f"{field}: must be a list of 2..26 probabilities in [0, 1], got {probs!r}")
    return [float(p) for p in probs]
