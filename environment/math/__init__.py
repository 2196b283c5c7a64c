"""Upstream OpenTinker's math game at its import path (`opentinker.environment.math`):

    from opentinker.environment.math import MathGame
    from opentinker.environment.math.math_env import MathGameEnvironment

`MathGame` is single-turn: the problem is the dataset row's prompt, `reset` gets the
row's `ground_truth`, and `step` scores the reply (math_game.py).
`CodeInterpreterMathGame` is multi-turn, with Python run in the user's sandbox
(math_tool_game.py; `opentinker sandbox` serves one), and
`math_tool_env.MathCodeInterpreterEnvironment` its dataset environment.
"""

from opentinker.environment.math.math_game import MathGame
from opentinker.environment.math.math_tool_game import CodeInterpreterMathGame

__all__ = ["CodeInterpreterMathGame", "MathGame"]
