"""Upstream OpenTinker's math game at its import path (`opentinker.environment.math`):

    from opentinker.environment.math import MathGame
    from opentinker.environment.math.math_env import MathGameEnvironment

`MathGame` is single-turn: the problem is the dataset row's prompt, `reset` gets the
row's `ground_truth`, and `step` scores the reply (math_game.py). Upstream's
`CodeInterpreterMathGame` (a Python tool) is not here; the built-in `code_math` env
(docs/environments.md) is this service's math-with-a-tool env.
"""

from opentinker.environment.math.math_game import MathGame

__all__ = ["MathGame"]
