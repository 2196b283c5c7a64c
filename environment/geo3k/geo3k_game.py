"""Geo3KGame: upstream OpenTinker's single-turn geometry game, at its import path
(opentinker/environment/geo3k/geo3k_game.py)."""

from __future__ import annotations

from opentinker.environment.math.math_game import MathGame


class Geo3KGame(MathGame):
    """Upstream's Geo3KGame: `Geo3KGame(max_retries=0)`; MathGame's reset, step and
    reward, interaction name "geo3k", no system prompt (upstream's rows carry the
    instruction)."""

    def __init__(self, max_retries: int = 0):
        super().__init__(max_retries=max_retries)
        self.data_source = "hiyouga/geometry3k"

    def get_system_prompt(self) -> str | None:  # type: ignore[override]
        return None

    def get_initial_user_message(self) -> str:
        return "Please solve the following geometry problem:"

    def get_interaction_name(self) -> str:
        return "geo3k"
