"""VLGameEnvironment: upstream OpenTinker's GameEnvironment for a vision-language model,
at its import path, with its constructor:

    env = VLGameEnvironment(game_class=Geo3KToolGame, config=args, data_paths=[args.data_path],
                            job_id=job_id, image_key="images")

Upstream tokenizes the rows with the model's AutoProcessor here; in this service the
rows stay in the caller's process and each row's images (the `image_key` column:
Hugging Face datasets' {"bytes", "path"}, bytes or paths) open its episode
(static_data_generator.py), and the rollout applies the model's processor.
"""

from __future__ import annotations

from typing import Any

from opentinker.environment.base_game import AbstractGame
from opentinker.environment.math.math_env import MathGameEnvironment


class VLGameEnvironment(MathGameEnvironment):
    """`VLGameEnvironment(game_class, config, data_paths, val_data_paths=None,
    game_kwargs=None, job_id=None, image_key="images")`. Raises as MathGameEnvironment,
    and ValueError naming the row's entry that is no image."""

    def __init__(self, game_class: type[AbstractGame], config: Any, data_paths: str | list[str],
                 val_data_paths: str | list[str] | None = None, game_kwargs: dict[str, Any] | None = None,
                 job_id: str | None = None, image_key: str = "images"):
        super().__init__(game_class, config, data_paths, val_data_paths, game_kwargs=game_kwargs, job_id=job_id,
                         image_key=image_key)


__all__ = ["VLGameEnvironment"]
