"""Geo3KToolEnvironment: upstream OpenTinker's multi-turn Geo3K environment, at its
import path (opentinker/environment/geo3k/geo3k_tool_env.py)."""

from __future__ import annotations

from typing import Any

from opentinker.environment.geo3k.geo3k_tool_game import Geo3KToolGame
from opentinker.environment.vl_game_environment import VLGameEnvironment


class Geo3KToolEnvironment(VLGameEnvironment):
    """Upstream's `Geo3KToolEnvironment(config, data_paths, val_data_paths=None,
    job_id=None, max_retries=3)`: Geo3KToolGame(max_retries) on rows with `images`.
    Raises as VLGameEnvironment."""

    def __init__(self, config: Any, data_paths: str | list[str], val_data_paths: str | list[str] | None = None,
                 job_id: str | None = None, max_retries: int = 3):
        super().__init__(Geo3KToolGame, config, data_paths, val_data_paths, game_kwargs={"max_retries": max_retries},
                         job_id=job_id, image_key="images")
