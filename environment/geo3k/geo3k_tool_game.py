"""Geo3KToolGame: upstream OpenTinker's multi-turn geometry game with answer
verification (github.com/open-tinker/OpenTinker, opentinker/environment/geo3k/
geo3k_tool_game.py; Apache-2.0), at its import path, with its constructor, reward
constants, prompts, feedback and step info.

    game = Geo3KToolGame(max_retries=3)
    game.reset(ground_truth="12")
    game.step("... \\boxed{10}")  # observation "Current parsed answer=10 reward=0.0", reward -0.05
    game.step("... \\boxed{12}")  # reward 1.0, done

Each reply is one attempt. The feedback is verl's Geo3kTool's ("Current parsed
answer={answer} reward={0.0|1.0}"). An attempt that does not beat the best so far
earns PENALTY_NO_IMPROVEMENT (-0.05); the episode ends on a correct answer (reward
1.0) or after `max_retries` attempts (reward: the last attempt's correctness).

The correctness: upstream asks verl's geo3k scorer (the last \\boxed{} answer, graded
by mathruler); here that boxed answer is checked with Math-Verify
(math_game.score_answer), so "\\frac{1}{2}" equals "0.5". No boxed answer scores 0.
"""

from __future__ import annotations

from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.environment.math.math_game import score_answer

NO_BOXED = "(no boxed answer)"


def last_boxed(text: str) -> str:
    """The content of the last `\\boxed{...}` in `text` (nested braces kept, as in
    `\\boxed{\\frac{8}{3}}`), stripped; NO_BOXED when there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return NO_BOXED
    content, depth = text[start + len("\\boxed{"):], 0
    for i, ch in enumerate(content):
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                return content[:i].strip()
            depth -= 1
    return NO_BOXED


class Geo3KToolGame(AbstractGame):
    """Multi-turn Geo3K: up to `max_retries` boxed answers, each answered with its
    parsed value and correctness (module docstring). Interaction name "geo3k_tool"."""

    REWARD_CORRECT = 1.0
    REWARD_INCORRECT = 0.0
    PENALTY_NO_IMPROVEMENT = -0.05

    def __init__(self, max_retries: int = 3):
        self.max_retries = max_retries
        self._init_game_state()

    def _init_game_state(self) -> None:
        self.ground_truth: Any = None
        self.data_source = "hiyouga/geometry3k"
        self.extra_info: dict[str, Any] = {}
        self.attempt_count = 0
        self.game_over = False
        self.best_reward = 0.0
        self.last_parsed_answer: str | None = None

    def reset(self, ground_truth: Any = None, data_source: str = "hiyouga/geometry3k",
              extra_info: dict[str, Any] | None = None, **kwargs: Any) -> str:
        """A new problem; returns "" (the problem and its figure are the row's prompt)."""
        self._init_game_state()
        self.ground_truth = ground_truth
        self.data_source = data_source
        self.extra_info = dict(extra_info or {})
        return ""

    def step(self, action: str) -> StepResult:
        """One attempt. info: ground_truth, data_source, attempt_count, parsed_answer,
        correctness_reward, is_correct, solution_str, and the row's extra_info."""
        if self.game_over:
            return StepResult(observation="Game already over.", reward=0.0, done=True, info={"error": "game_over"})
        self.attempt_count += 1
        parsed = self.last_parsed_answer = last_boxed(action)
        correct = self._compute_reward(action)
        penalty = 0.0 if correct > self.best_reward else self.PENALTY_NO_IMPROVEMENT
        self.best_reward = max(self.best_reward, correct)
        is_correct = correct == self.REWARD_CORRECT
        done = is_correct or self.attempt_count >= self.max_retries
        self.game_over = done
        info = {"ground_truth": self.ground_truth, "data_source": self.data_source,
                "attempt_count": self.attempt_count, "parsed_answer": parsed, "correctness_reward": correct,
                "is_correct": is_correct, "solution_str": action, **self.extra_info}
        return StepResult(observation=f"Current parsed answer={parsed} reward={correct}",
                          reward=correct if done else penalty, done=done, info=info)

    def _compute_reward(self, solution_str: str) -> float:
        parsed = last_boxed(solution_str)
        if parsed == NO_BOXED or self.ground_truth is None:
            return self.REWARD_INCORRECT
        return self.REWARD_CORRECT if score_answer(f"\\boxed{{{parsed}}}", self.ground_truth) else self.REWARD_INCORRECT

    def get_system_prompt(self) -> str:
        return ("You are a geometry expert. You are given a geometry problem with an image. "
                "Solve it step by step. After reasoning, submit your answer in \\boxed{} format. "
                "If your answer is incorrect, you will receive feedback showing the parsed answer and reward. "
                "You can then refine your thinking and submit again.")

    def get_initial_user_message(self) -> str:
        return "Please solve the following geometry problem:"

    def get_state(self) -> dict[str, Any]:
        return {"ground_truth": self.ground_truth, "data_source": self.data_source,
                "attempt_count": self.attempt_count, "game_over": self.game_over, "best_reward": self.best_reward,
                "last_parsed_answer": self.last_parsed_answer}

    def get_interaction_name(self) -> str:
        return "geo3k_tool"

    def generate_initial_state(self) -> dict[str, Any]:  # type: ignore[override]
        return {}

    def get_user_message_with_state(self, **state: Any) -> str:
        return self.get_initial_user_message()
