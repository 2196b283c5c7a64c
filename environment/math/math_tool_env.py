"""MathCodeInterpreterEnvironment: upstream OpenTinker's dataset environment for
CodeInterpreterMathGame, at its import path, with its constructor (math_env.py's)."""

from __future__ import annotations

from opentinker.environment.math.math_env import MathGameEnvironment


class MathCodeInterpreterEnvironment(MathGameEnvironment):
    """`MathCodeInterpreterEnvironment(game_class, config, data_paths,
    val_data_paths=None, game_kwargs=None, job_id=None)`: as MathGameEnvironment."""
