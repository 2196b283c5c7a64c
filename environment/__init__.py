"""The environment API users implement, at OpenTinker's own import path:

    from opentinker.environment.base_game import AbstractGame, StepResult

    base_game.py   AbstractGame (required: reset, step, get_system_prompt,
                   get_initial_user_message; optional: generate_initial_state,
                   render_state_for_prompt, get_user_message_with_state,
                   get_interaction_name, get_state, parse_action, get_tools) and StepResult

Beside it, upstream OpenTinker's client-side modules at its import paths (imported
only when asked for):

    base_game_environment.py  GameEnvironment: a game (and its dataset) served from the
                              caller's process as the user's own env
    inference_pipeline.py     run_inference: a game against an OpenAI-compatible endpoint
    static_data_generator.py  dataset rows (Parquet, JSON(L)) as prompts and reset kwargs
    math/                     MathGame, MathGameEnvironment: upstream's math game on a dataset
                              (and CodeInterpreterMathGame, with a Python sandbox)
    gomoku/, geo3k/           upstream's Gomoku, and Geo3K for vision-language models
    alfworld/                 upstream's ALFWorldGame (needs the alfworld package and games)
    vl_game_environment.py    VLGameEnvironment: a game on dataset rows with images
    game_stats_client.py      GameStatsClient: per-job game statistics, kept in this process

Imports only the standard library: part of the client install, so an environment is
written and tried on a laptop without torch.
"""

from opentinker.environment.base_game import AbstractGame, StepResult

__all__ = ["AbstractGame", "StepResult"]
