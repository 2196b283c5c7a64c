"""MathGame: upstream OpenTinker's single-turn math game (github.com/open-tinker/OpenTinker,
opentinker/environment/math/math_game.py; Apache-2.0): same constructor, methods,
reward constants, system prompt and step info.

    game = MathGame()
    game.reset(ground_truth="42")
    game.step("... so the answer is \\boxed{42}").reward   # 1.0

The reward: upstream asks verl's `default_compute_score`; here the reply is checked
with Math-Verify (github.com/huggingface/Math-Verify; the verifier of the built-in
gsm8k env, services/envhost/envs/answers.py): the boxed answer first, else the last
expression of the reply (after a "####" mark when there is one), compared to the
ground truth as mathematics ("0.5" equals "\\frac{1}{2}"). Without math-verify
installed (it is in the `server` and `upstream` extras), upstream's own fallback
scores: the boxed answer, else the whole reply, must contain the ground truth
(case-insensitive). An `answer_pattern` regex, when given, picks the answer first
(its first group, else the whole match). Runs on the client install's standard
library plus, optionally, math-verify.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult

log = logging.getLogger("opentinker.environment.math")

_BOXED = re.compile(r"\\boxed\{([^}]+)\}")


def score_answer(solution: str, ground_truth: Any) -> float:
    """1.0 when `solution` states `ground_truth`, else 0.0 (see the module docstring:
    Math-Verify, else upstream's containment fallback). Safe from any thread."""
    if ground_truth is None:
        return 0.0
    try:
        from opentinker.services.envhost.envs.answers import verify_answer

        return 1.0 if verify_answer(solution, str(ground_truth))[0] else 0.0
    except ImportError:
        log.warning("math-verify is not installed (pip install 'opentinker[upstream]'): scoring by containment")
    boxed = _BOXED.search(solution)
    got = (boxed.group(1) if boxed else solution).strip().lower()
    return 1.0 if str(ground_truth).strip().lower() in got else 0.0


class MathGame(AbstractGame):
    """Single-turn math: `reset(ground_truth=, data_source=, extra_info=)`, then one
    `step(reply)` scored REWARD_CORRECT (1.0) or REWARD_INCORRECT (0.0); the game is
    over after it. `max_retries` is kept for upstream's signature (its game is
    single-turn whatever the value); `answer_pattern` is a regex that picks the answer
    out of the reply before scoring."""

    REWARD_CORRECT = 1.0
    REWARD_INCORRECT = 0.0
    REWARD_FORMAT_ERROR = 0.0

    def __init__(self, max_retries: int = 0, answer_pattern: str | None = None):
        self.max_retries = max_retries
        self.answer_pattern = answer_pattern
        self._pattern = re.compile(answer_pattern) if answer_pattern else None
        self._init_game_state()

    def _init_game_state(self) -> None:
        self.ground_truth: Any = None
        self.data_source = "math"
        self.extra_info: dict[str, Any] = {}
        self.attempt_count = 0
        self.game_over = False

    def reset(self, ground_truth: Any = None, data_source: str = "math", extra_info: dict[str, Any] | None = None,
              **kwargs: Any) -> str:
        """A new problem; returns "" (the problem is the row's prompt)."""
        self._init_game_state()
        self.ground_truth = ground_truth
        self.data_source = data_source
        self.extra_info = dict(extra_info or {})
        return ""

    def step(self, action: str) -> StepResult:
        """Score the reply; done=True. info: ground_truth, data_source, attempt,
        solution_str, and the row's extra_info."""
        if self.game_over:
            return StepResult(observation="Game already over.", reward=0.0, done=True, info={"error": "game_over"})
        self.attempt_count += 1
        self.game_over = True
        info = {"ground_truth": self.ground_truth, "data_source": self.data_source, "attempt": self.attempt_count,
                "solution_str": action, **self.extra_info}
        return StepResult(observation="", reward=self._compute_reward(action), done=True, info=info)

    def _compute_reward(self, solution_str: str) -> float:
        if self._pattern is not None:
            m = self._pattern.search(solution_str)
            if m is None:
                return self.REWARD_FORMAT_ERROR
            solution_str = m.group(1) if m.groups() else m.group(0)
        return self.REWARD_CORRECT if score_answer(solution_str, self.ground_truth) else self.REWARD_INCORRECT

    def get_system_prompt(self) -> str:
        return ("You are a helpful assistant that solves math problems step by step. "
                "Think through the problem carefully and provide your final answer. "
                "Put your final answer in \\boxed{} format.")

    def get_initial_user_message(self) -> str:
        return "Please solve the following problem:"

    def get_state(self) -> dict[str, Any]:
        return {"ground_truth": self.ground_truth, "data_source": self.data_source,
                "attempt_count": self.attempt_count, "game_over": self.game_over}

    def get_interaction_name(self) -> str:
        return "math"

    def get_user_message_with_state(self, **state: Any) -> str:
        return self.get_initial_user_message()
