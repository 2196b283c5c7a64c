"""MathGameEnvironment: upstream OpenTinker's GameEnvironment for a math dataset, at its
import path (opentinker/environment/math/math_env.py), with its constructor:

    env = MathGameEnvironment(game_class=MathGame, config=args, data_paths=[args.data_path],
                              val_data_paths=[args.val_data_path], job_id=job_id)

Upstream builds tokenized dataloaders here; this service reads the rows in the
caller's process and serves the game with them (base_game_environment.py), so a row
never leaves the user's machine.
"""

from __future__ import annotations

from typing import Any

from opentinker.environment.base_game import AbstractGame
from opentinker.environment.base_game_environment import GameEnvironment


class MathGameEnvironment(GameEnvironment):
    """A math game on dataset rows. `data_paths` (a path or a list: Parquet or JSON
    lines in upstream's columns) is required; `val_data_paths` optional. Raises
    ValueError for no rows or a row that cannot open an episode (naming the file and
    row), ImportError naming pyarrow for Parquet without it."""

    def __init__(self, game_class: type[AbstractGame], config: Any, data_paths: str | list[str],
                 val_data_paths: str | list[str] | None = None, game_kwargs: dict[str, Any] | None = None,
                 job_id: str | None = None, *, image_key: str = "images"):
        self.data_paths = [data_paths] if isinstance(data_paths, str) else list(data_paths or [])
        self.val_data_paths = ([val_data_paths] if isinstance(val_data_paths, str)
                               else (list(val_data_paths) if val_data_paths else None))
        if not [p for p in self.data_paths if p]:
            raise ValueError(f"data_paths: {type(self).__name__} needs its training data (Parquet or JSON lines)")
        super().__init__(game_class, config, game_kwargs=game_kwargs, job_id=job_id,
                         data_paths=self.data_paths, val_data_paths=self.val_data_paths, image_key=image_key)
