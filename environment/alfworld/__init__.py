"""Upstream OpenTinker's ALFWorld game at its import path:

    from opentinker.environment.alfworld import ALFWorldGame
    env = GameEnvironment(game_class=ALFWorldGame, config=args, game_kwargs={"max_steps": 20, "split": "train"})

See alfworld_game.py. Needs the `alfworld` package (pip install alfworld) and ALFWorld's
games on the machine that runs the script.
"""

from opentinker.environment.alfworld.alfworld_game import ALFWorldGame

__all__ = ["ALFWorldGame"]
