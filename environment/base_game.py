"""The environment API a user implements: OpenTinker's AbstractGame and StepResult.

An environment is the user's only code: the same class drives training, evaluation
and inference. It is served by `opentinker envhost --env my_module:MyGame`. A class
written for OpenTinker (`from opentinker.environment.base_game import AbstractGame,
StepResult`) runs unchanged:

    class MyGame(AbstractGame):
        def reset(self, **kwargs) -> str: ...              # first observation
        def step(self, action: str) -> StepResult: ...     # one turn
        def get_system_prompt(self) -> str: ...
        def get_initial_user_message(self) -> str: ...
        # optional
        def generate_initial_state(self) -> dict: ...      # random.seed(group seed) first
        def render_state_for_prompt(self, **state) -> str: ...
        def get_user_message_with_state(self, **state) -> str: ...
        def get_interaction_name(self) -> str: ...         # default: "my" for MyGame
        def get_tools(self) -> list[dict]: ...             # tools the model may call
        def get_initial_images(self) -> list: ...          # images for a vision-language model
        def get_privileged_context(self) -> str: ...       # what a distillation teacher also reads
        def close(self) -> None: ...                       # the episode is over: let go of its resources

`__init__(**env_args)` receives the job's `env_args`. One instance serves one episode.

How the envhost drives a class, per GRPO group and episode:

- The group's state: `generate_initial_state(seed, split)` when the method takes a
  `seed` (the seeded form, which can keep train and test problems apart); otherwise
  Python's `random` is seeded with the group's seed and `generate_initial_state()` is
  called with no arguments, as OpenTinker's data generator does. Either way a group
  seed always gives the same state.
- An episode: `reset(**state)`, then the first user message. A class that overrides
  `get_user_message_with_state` (or `render_state_for_prompt`) gets its own message,
  asked before `reset` as OpenTinker builds its prompts; otherwise the message is
  `get_initial_user_message()` followed by the first observation when there is one
  (OpenTinker's default rendering, with `reset`'s output as the rendered state).
- Its name: `get_interaction_name()`; a class attribute `name` or `--name` sets it too.

Images (a vision-language env): `get_initial_images()`, asked after the first user
message is built, gives the images shown with that message; `StepResult.images` the
images shown with a step's observation. Each image is a `PIL.Image.Image`, the bytes of
a PNG or JPEG file (other formats Pillow reads are converted to PNG), or a str /
pathlib.Path naming an image file. A message's images are placed, in order, before its
text. The envhost checks them with environment/images.py (at most 8 a message, each at
most 2 MiB encoded and 4096 x 4096 pixels); an image it cannot read or over a limit
ends the episode with an error naming it, like an exception in `step`.

Privileged context (on-policy self-distillation): `get_privileged_context()`, asked after
`reset` when a job's teacher reads it (JobSpec teacher_context = "privileged"), is text
the teacher reads after the first user message and the policy never sees: the answer,
a reference solution, a hint.

Tool use: an env that returns OpenAI-style function schemas from `get_tools()` has
them rendered by the model's chat template when the template defines tools (and its
observations sent back as `tool` messages); with a template that does not, the env's
own system prompt describes the format (e.g. a fenced code block). `step` parses
either from the action text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What `step` returns. `reward` is this turn's reward; `done` ends the episode;
    `images` are shown, in order, before the observation's text (see the module
    docstring for what an image may be)."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)


class AbstractGame:
    """Base class for environments (see the module docstring for how it is driven).

    Required overrides: `reset`, `step`, `get_system_prompt` (default ""),
    `get_initial_user_message` (without it the first observation stands in).
    """

    #: the served name ([a-z0-9][a-z0-9_-]*); empty: get_interaction_name()'s default
    name: str = ""

    def __init__(self, **env_args: Any):
        self.env_args = env_args

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """The kwargs for `reset` shared by one GRPO group (the seeded form). Default:
        just the seed. A subclass may instead define `generate_initial_state(self)`
        and draw from Python's `random`, which the envhost seeds with the group's seed."""
        return {"seed": seed}

    def reset(self, **state: Any) -> str:
        """Start an episode from `state`; returns the first observation (may be "")."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """Apply the model's `action` text; returns observation, reward, done, info."""
        raise NotImplementedError

    def get_system_prompt(self) -> str:
        return ""

    def get_initial_user_message(self) -> str:
        raise NotImplementedError

    def render_state_for_prompt(self, **state: Any) -> str:
        """The initial state as prompt text. Default (OpenTinker's): `reset(**state)`."""
        return self.reset(**state)

    def get_user_message_with_state(self, **state: Any) -> str:
        """The first user message for `state`. Default (OpenTinker's): the initial user
        message, a blank line, the rendered state."""
        return f"{self.get_initial_user_message()}\n\n{self.render_state_for_prompt(**state)}"

    def get_tools(self) -> list[dict[str, Any]]:
        """Tools the model may call, as OpenAI-style function schemas
        (`{"type": "function", "function": {"name", "description", "parameters"}}`).
        Default: none."""
        return []

    def get_initial_images(self) -> list[Any]:
        """The images shown, in order, before the first user message's text: each a
        `PIL.Image.Image`, PNG or JPEG file bytes, or a path to an image file. Asked
        after `reset` and the first user message. Default: none."""
        return []

    def get_privileged_context(self) -> str:
        """Text a distillation teacher reads after the first user message and the policy
        never sees (JobSpec teacher_context = "privileged"), e.g. the answer or a reference
        solution: on-policy self-distillation (OPSD, arXiv 2601.18734) scores the
        policy's tokens by a teacher that knows it. Asked after `reset`. Default: ""."""
        return ""

    def get_state(self) -> dict[str, Any]:
        """The current game state, for debugging and display. Default: {}."""
        return {}

    def get_interaction_name(self) -> str:
        """The name the env is served under: the class attribute `name` when set, else
        OpenTinker's default, the class name lower-cased without "game"."""
        return self.name or type(self).__name__.lower().replace("game", "")

    def parse_action(self, raw_action: str) -> Any:
        """The action in the model's raw text (None if it has none). Default: the text."""
        return raw_action

    @staticmethod
    def rng(seed: Any) -> random.Random:
        """A private random generator for `seed` (an int or a string)."""
        return random.Random(seed)


def opening(game: AbstractGame, state: dict[str, Any]) -> tuple[str, str]:
    """Reset `game` to `state` and return its episode's (system prompt, first user
    message), as OpenTinker builds its prompts: the class's own
    `get_user_message_with_state(**state)` when it overrides that (or
    `render_state_for_prompt`), asked before `reset`; else the initial user message and
    `reset`'s observation, a blank line between, either one alone when the other is
    empty. The envhost (training) and `run_inference` (the client) both open episodes
    with it, so a policy sees the same prompts in both."""
    cls = type(game)
    custom = any(getattr(cls, m) is not getattr(AbstractGame, m)
                 for m in ("get_user_message_with_state", "render_state_for_prompt"))
    user = game.get_user_message_with_state(**state) if custom else ""
    obs = game.reset(**state)
    system = game.get_system_prompt()
    if not custom:
        try:
            first = game.get_initial_user_message()
        except NotImplementedError:
            first = ""
        user = "\n\n".join(str(x) for x in (first, obs) if x)
    return str(system or ""), str(user or "")
