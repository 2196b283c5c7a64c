"""Upstream OpenTinker's Geo3K (geometry problems with a figure, for vision-language
models) at its import paths (`opentinker.environment.geo3k`):

    env = Geo3KGameEnvironment(config=args, data_paths=[args.data_path], job_id=job_id)
    env = Geo3KToolEnvironment(config=args, data_paths=[args.data_path], job_id=job_id, max_retries=3)

`Geo3KGame` is single-turn like MathGame (geo3k_game.py); `Geo3KToolGame` answers each
boxed attempt with its parsed value and correctness, up to `max_retries` attempts
(geo3k_tool_game.py). The rows' `images` are each episode's initial images
(static_data_generator.py).
"""

from opentinker.environment.geo3k.geo3k_env import Geo3KGameEnvironment
from opentinker.environment.geo3k.geo3k_game import Geo3KGame
from opentinker.environment.geo3k.geo3k_tool_env import Geo3KToolEnvironment
from opentinker.environment.geo3k.geo3k_tool_game import Geo3KToolGame

__all__ = ["Geo3KGame", "Geo3KGameEnvironment", "Geo3KToolGame", "Geo3KToolEnvironment"]
