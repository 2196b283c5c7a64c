"""Geo3KGameEnvironment: upstream OpenTinker's Geo3K environment, at its import path
(opentinker/environment/geo3k/geo3k_env.py)."""

from __future__ import annotations

from typing import Any

from opentinker.environment.geo3k.geo3k_game import Geo3KGame
from opentinker.environment.vl_game_environment import VLGameEnvironment


class Geo3KGameEnvironment(VLGameEnvironment):
    """Upstream's `Geo3KGameEnvironment(config, data_paths, val_data_paths=None,
    job_id=None)`: Geo3KGame on Parquet rows with `images`. Raises as
    VLGameEnvironment."""

    def __init__(self, config: Any, data_paths: str | list[str], val_data_paths: str | list[str] | None = None,
                 job_id: str | None = None):
        super().__init__(Geo3KGame, config, data_paths, val_data_paths, job_id=job_id)
