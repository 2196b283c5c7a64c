"""The environment API users implement, at OpenTinker's own import path:

    from opentinker.environment.base_game import AbstractGame, StepResult

    base_game.py   AbstractGame (required: reset, step, get_system_prompt,
                   get_initial_user_message; optional: generate_initial_state,
                   render_state_for_prompt, get_user_message_with_state,
                   get_interaction_name, get_state, parse_action, get_tools) and StepResult

Imports only the standard library: part of the client install, so an environment is
written and tried on a laptop without torch.
"""

from opentinker.environment.base_game import AbstractGame, StepResult

__all__ = ["AbstractGame", "StepResult"]
