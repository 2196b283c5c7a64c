"""The built-in environments, by name. `opentinker envhost` with no `--env` serves all."""

from __future__ import annotations

from opentinker.environment.base_game import AbstractGame
from opentinker.services.envhost.envs.alfworld import AlfWorldGame
from opentinker.services.envhost.envs.android_world import AndroidWorldGame
from opentinker.services.envhost.envs.arith import ArithGame
from opentinker.services.envhost.envs.bandit import BanditGame
from opentinker.services.envhost.envs.code_math import CodeMathGame
from opentinker.services.envhost.envs.geometry3k import Geometry3kGame, Geometry3kToolGame
from opentinker.services.envhost.envs.gomoku import GomokuGame
from opentinker.services.envhost.envs.gsm8k import GSM8KGame
from opentinker.services.envhost.envs.guess_number import GuessNumberGame
from opentinker.services.envhost.envs.scienceworld import ScienceWorldGame
from opentinker.services.envhost.envs.selfplay import GomokuDuelGame, NegotiationGame
from opentinker.services.envhost.envs.simulated_user import SimulatedUserGame
from opentinker.services.envhost.envs.swe import SWEGame

BUILTIN: dict[str, type[AbstractGame]] = {
    cls.name: cls for cls in (ArithGame, GSM8KGame, GuessNumberGame, CodeMathGame, GomokuGame, BanditGame,
                              GomokuDuelGame, NegotiationGame, ScienceWorldGame, AlfWorldGame, AndroidWorldGame,
                              Geometry3kGame, Geometry3kToolGame, SimulatedUserGame, SWEGame)
}
