"""Upstream OpenTinker's Gomoku game at its import path (`opentinker.environment.gomoku`):

    from opentinker.environment.gomoku import GomokuGame
    env = GameEnvironment(game_class=GomokuGame, config=args, game_kwargs={"board_size": 9})

`GomokuGameStats` is None: upstream's server-side statistics class has no place here
(the game runs in the caller's process; see game_stats_client.py). This service's own
`gomoku` env (services/envhost/envs/gomoku.py, docs/environments.md) is a different
game: letters-and-numbers moves, seeded opponents, held-out splits.
"""

from opentinker.environment.gomoku.gomoku_game import GomokuGame

GomokuGameStats = None

__all__ = ["GomokuGame", "GomokuGameStats"]
