"""Upstream OpenTinker's Geo3K (geometry problems with a figure, for vision-language
models) at its import path (`opentinker.environment.geo3k`):

    env = Geo3KGameEnvironment(config=args, data_paths=[args.data_path], job_id=job_id)

`Geo3KGame` is single-turn like MathGame (the row's `ground_truth`, the reply scored by
math_game.score_answer), with no system prompt of its own (upstream's rows carry the
instruction). The rows' `images` are each episode's initial images
(static_data_generator.py). Upstream's tool variant (Geo3KToolGame) is not here.
"""

from __future__ import annotations

from typing import Any

from opentinker.environment.math.math_env import MathGameEnvironment
from opentinker.environment.math.math_game import MathGame


class Geo3KGame(MathGame):
    """Upstream's Geo3KGame: `Geo3KGame(max_retries=0)`; MathGame's reset, step and
    reward, interaction name "geo3k", no system prompt."""

    def __init__(self, max_retries: int = 0):
        super().__init__(max_retries=max_retries)
        self.data_source = "hiyouga/geometry3k"

    def get_system_prompt(self) -> str | None:  # type: ignore[override]
        return None

    def get_initial_user_message(self) -> str:
        return "Please solve the following geometry problem:"

    def get_interaction_name(self) -> str:
        return "geo3k"


class Geo3KGameEnvironment(MathGameEnvironment):
    """Upstream's `Geo3KGameEnvironment(config, data_paths, val_data_paths=None,
    job_id=None)`: Geo3KGame on Parquet rows with `images`. Raises as
    MathGameEnvironment."""

    def __init__(self, config: Any, data_paths: str | list[str], val_data_paths: str | list[str] | None = None,
                 job_id: str | None = None):
        super().__init__(Geo3KGame, config, data_paths, val_data_paths, job_id=job_id)


__all__ = ["Geo3KGame", "Geo3KGameEnvironment"]
