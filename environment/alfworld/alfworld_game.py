"""ALFWorldGame: upstream OpenTinker's ALFWorld game (github.com/open-tinker/OpenTinker,
opentinker/environment/alfworld/alfworld_game.py; Apache-2.0), written anew with its
constructor, rewards, prompts, observation text, action parsing and step info.
ALFWorld: Shridhar et al., ICLR 2021 (arXiv 2010.03768), household tasks as TextWorld
games.

    game = ALFWorldGame(max_steps=20, split="train")
    first = game.get_user_message_with_state(**game.generate_initial_state())
    game.step("<thinking>...</thinking><action>go to fridge 1</action>")

Games: `game.tw-pddl` files as `alfworld-download` lays them out,
<root>/json_2.1.1/<folder>/<task_type>-*/trial_*/, with <folder> train (split
"train"), valid_seen ("eval_in_distribution"), valid_unseen
("eval_out_of_distribution") or the split's own name. <root> is the first of
$ALFWORLD_DATA, ./alfworld_data and ~/.cache/alfworld that holds json_2.1.1 (upstream
looks for its repository's alfworld_data; here the one in the folder the script was
started in, before hydra moved it to outputs/; upstream also asks for a logic/ folder,
which a game file does not need).
`num_games` > 0 keeps that many games, drawn with random.Random(42) as upstream. An
episode's game is `random.Random(seed).choice(games)`, the game upstream's
`random.seed(seed); random.choice(games)` picks, without reseeding the process's
`random` (the served game runs beside other episodes here); `task_type` is accepted
and, as upstream, not used to choose.

Rewards: REWARD_SUCCESS (10) when the game ends won, REWARD_FAILURE (-1) when it ends
otherwise or after `max_steps` commands (with "TIMEOUT: ..." before the observation),
else REWARD_STEP (-0.01) a command, REWARD_INVALID_ACTION (-0.1) when the game says
"Nothing happens" (a command it cannot do). The command is the reply's
<action>...</action>, else its last line. Each observation is followed by the
admissible commands. info: raw_reward, action_taken, task, won, success, lost.

How it is played: TextWorld's PDDL backend with ALFWorld's AlfredDemangler (object ids
read "apple 1"), as upstream's `textworld.start(game, infos, [Filter, AlfredDemangler()])`,
in environments a finished episode hands to the next, one game call at a time in this
process (textworld_envs.py, shared with the built-in `alfworld` env).
"""

from __future__ import annotations

import glob
import os
import random
import re
import threading
import weakref
from pathlib import Path
from typing import Any

from opentinker.environment.alfworld.textworld_envs import TEXTWORLD_LOCK, EnvPool
from opentinker.environment.base_game import AbstractGame, StepResult

SPLIT_FOLDERS = {"train": "train", "eval_in_distribution": "valid_seen", "eval_out_of_distribution": "valid_unseen"}
_ACTION = re.compile(r"<action>\s*(.*?)\s*</action>", re.IGNORECASE | re.DOTALL)

_games: dict[tuple[str, str, tuple[str, ...], int], list[str]] = {}
_games_lock = threading.Lock()


def _textworld() -> tuple[Any, Any, Any]:
    """(textworld, its Filter wrapper, ALFWorld's AlfredDemangler). Raises ImportError
    naming the package to install."""
    try:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
        from textworld.envs.wrappers import Filter
    except ImportError as e:
        raise ImportError("ALFWorldGame needs the alfworld package (it brings textworld): pip install alfworld") from e
    return textworld, Filter, AlfredDemangler


def _new_env() -> Any:
    textworld, Filter, AlfredDemangler = _textworld()
    from textworld.envs.wrappers import GenericEnvironment

    infos = textworld.EnvInfos(feedback=True, admissible_commands=True, won=True, lost=True)
    return AlfredDemangler()(Filter(GenericEnvironment(infos)))


_envs = EnvPool(_new_env)


def data_root() -> str:
    """The ALFWorld data folder (module docstring): the first candidate holding
    json_2.1.1, else $ALFWORLD_DATA, else ~/.cache/alfworld."""
    from opentinker.client.utils.utils import launch_dir

    env_root = os.path.expandvars(os.environ.get("ALFWORLD_DATA", "")).strip()
    cache = os.path.expanduser("~/.cache/alfworld")
    for candidate in [c for c in (env_root, os.path.join(launch_dir(), "alfworld_data"), cache) if c]:
        if os.path.isdir(os.path.join(candidate, "json_2.1.1")):
            return candidate
    return env_root or cache


def _flag(info: Any, key: str) -> bool | None:
    """A won/lost flag of TextWorld's infos as a bool (None when absent): bools,
    numbers, "true"/"false"-like strings, or a batch's first entry."""
    value = info.get(key) if isinstance(info, dict) else None
    while isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        return True if text in {"true", "1", "yes", "y"} else False if text in {"false", "0", "no", "n"} else None
    return None


class ALFWorldGame(AbstractGame):
    """One ALFWorld game an episode, one command a turn (module docstring).

    Args: `config_path` (an ALFWorld YAML; read, as upstream, and otherwise unused),
    `max_steps` (commands before the timeout, default 20), `task_types` (names of
    ALL_TASK_TYPES; default all), `split`, `num_games` (-1: all), `use_shared_env`
    (accepted; environments are always pooled here). Raises ImportError without
    alfworld; `reset` raises RuntimeError when the split has no game.
    """

    REWARD_SUCCESS = 10.0
    REWARD_FAILURE = -1.0
    REWARD_STEP = -0.01
    REWARD_INVALID_ACTION = -0.1
    DEFAULT_MAX_STEPS = 20
    ALL_TASK_TYPES = ["pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                      "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place"]

    def __init__(self, config_path: str | None = None, max_steps: int = DEFAULT_MAX_STEPS,
                 task_types: list[str] | None = None, split: str = "train", num_games: int = -1,
                 use_shared_env: bool = False):
        _textworld()
        self.config_path = config_path
        if config_path:
            import yaml

            self._config = yaml.safe_load(Path(config_path).read_text())
        self.max_steps = max_steps
        self.task_types = list(task_types or self.ALL_TASK_TYPES)
        self.split = split
        self.num_games = num_games
        self._use_shared_env = use_shared_env
        self._env: Any = None
        self._release: Any = None
        self._current_obs: str | None = None
        self._step_count = 0
        self._task_desc = ""
        self._admissible_commands: list[str] = []
        self._done = False

    def _get_cached_game_paths(self) -> list[str]:
        """The split's trial folders holding a game file, sorted (`num_games` of them
        when > 0); the disk is scanned once per process and key."""
        root = data_root()
        key = (root, self.split, tuple(sorted(self.task_types)), self.num_games)
        with _games_lock:
            if key not in _games:
                base = os.path.join(root, "json_2.1.1", SPLIT_FOLDERS.get(self.split, self.split))
                paths = sorted(trial for task_type in self.task_types
                               for trial in glob.glob(os.path.join(base, f"{task_type}-*", "trial_*"))
                               if os.path.exists(os.path.join(trial, "game.tw-pddl"))
                               or glob.glob(os.path.join(trial, "game.*")))
                if 0 < self.num_games < len(paths):
                    paths = sorted(random.Random(42).sample(paths, self.num_games))
                _games[key] = paths
            return _games[key]

    def reset(self, task_type: str | None = None, seed: int | None = None, **kwargs: Any) -> str:
        """Load the game `seed` picks (any when None) and return its first observation
        with the admissible commands. Raises RuntimeError when there is no game."""
        paths = self._get_cached_game_paths()
        if not paths:
            raise RuntimeError(f"No games found for split='{self.split}', task_types={self.task_types} under "
                               f"{data_root()}/json_2.1.1 (set ALFWORLD_DATA to the folder `alfworld-download` fills)")
        trial = (random.Random(seed) if seed is not None else random).choice(paths)
        game_file = os.path.join(trial, "game.tw-pddl")
        if not os.path.exists(game_file):
            others = glob.glob(os.path.join(trial, "game.*"))
            if not others:
                raise RuntimeError(f"No game file found in {trial}")
            game_file = others[0]
        if self._env is None:
            self._env = _envs.borrow()
            # an episode dropped without close() returns its environment when collected
            self._release = weakref.finalize(self, _envs.give_back, self._env)
        with TEXTWORLD_LOCK:
            self._env.load(game_file)
            obs, info = self._env.reset()
        self._current_obs = str(obs)
        self._task_desc = self._extract_task_description(self._current_obs)
        self._admissible_commands = list(info.get("admissible_commands") or [])
        self._step_count = 0
        self._done = False
        return self._format_observation(self._current_obs)

    def close(self) -> None:
        """Return this episode's environment to the process's pool (once)."""
        if self._release is not None:
            self._release()
        self._env, self._release = None, None

    @staticmethod
    def _extract_task_description(obs: str) -> str:
        return next((line for line in obs.strip().split("\n") if line.startswith("Your task is to")),
                    "Complete the household task.")

    def _format_observation(self, obs: str) -> str:
        text = f"=== Current State ===\n{obs}\n"
        if self._admissible_commands:
            text += "\n=== Available Actions ===\n" + "\n".join(f"- {c}" for c in self._admissible_commands)
        return text

    def step(self, action: str) -> StepResult:
        """Send the reply's command to the game (module docstring for the rewards)."""
        if self._done:
            return StepResult(observation="Episode already finished.", reward=0.0, done=True,
                              info={"error": "episode_finished"})
        if self._env is None:
            raise RuntimeError("step: the episode is not running (reset first)")
        self._step_count += 1
        command = self._parse_action(action)
        with TEXTWORLD_LOCK:
            obs, reward, done, info = self._env.step(command)
        won, lost = _flag(info, "won"), _flag(info, "lost")
        obs = self._current_obs = str(obs)
        self._admissible_commands = list(info.get("admissible_commands") or [])
        if self._step_count >= self.max_steps and not done:
            done, reward, won, lost = True, self.REWARD_FAILURE, False, True
            obs = f"TIMEOUT: Maximum steps ({self.max_steps}) reached.\n\n{obs}"
        if done and reward > 0:
            final = self.REWARD_SUCCESS
            obs = f"SUCCESS! Task completed!\n\n{obs}"
        elif done:
            final = self.REWARD_FAILURE
        else:
            invalid = "Nothing happens" in obs or "invalid" in obs.lower()
            final = self.REWARD_INVALID_ACTION if invalid else self.REWARD_STEP
        if won is None and done:
            won = bool(reward > 0)
        self._done = bool(done)
        info_out = {"raw_reward": float(reward), "action_taken": command, "task": self._task_desc, "won": won,
                    "success": bool(won), "lost": lost}
        return StepResult(observation=self._format_observation(obs), reward=final, done=bool(done), info=info_out)

    @staticmethod
    def _parse_action(raw_action: str) -> str:
        m = _ACTION.search(raw_action)
        return m.group(1).strip() if m else raw_action.strip().split("\n")[-1].strip()

    def get_system_prompt(self) -> str:
        return ("You are an AI assistant playing ALFWorld, a text-based household environment.\n"
                "Your goal is to complete household tasks by interacting with objects.\n\n"
                "IMPORTANT: You MUST respond in the following format:\n"
                "1. First, think about your plan in <thinking></thinking> tags\n"
                "2. Then, output your action in <action></action> tags\n\n"
                "Common actions:\n"
                "- go to [receptacle]: Move to a location (e.g., 'go to desk 1')\n"
                "- take [object] from [receptacle]: Pick up an object\n"
                "- put [object] in/on [receptacle]: Place an object\n"
                "- open [receptacle]: Open a container\n"
                "- close [receptacle]: Close a container\n"
                "- use [object]: Use a device (lamp, microwave, etc.)\n"
                "- examine [object]: Look at an object closely\n"
                "- inventory: Check what you're holding\n"
                "- look: Look around the room\n\n"
                "Example response:\n"
                "<thinking>I need to find the book first. Let me check the desk.</thinking>\n"
                "<action>go to desk 1</action>")

    def get_initial_user_message(self) -> str:
        return (f"Task: {self._task_desc}\n\n"
                "Explore the environment and complete the task. What would you like to do first?")

    def get_state(self) -> dict[str, Any]:
        return {"observation": self._current_obs, "task": self._task_desc, "step_count": self._step_count,
                "max_steps": self.max_steps, "done": self._done,
                "admissible_commands": self._admissible_commands[:10]}

    def generate_initial_state(self) -> dict[str, Any]:  # type: ignore[override]
        """{"task_type", "seed"} drawn from `random` (the envhost seeds it per group)."""
        return {"task_type": random.choice(self.task_types), "seed": random.randint(0, 1000000)}

    def get_user_message_with_state(self, task_type: str | None = None, **kwargs: Any) -> str:
        """Reset to the state's game and return the first user message: the task, the
        room and the admissible commands."""
        self.reset(task_type=task_type, **kwargs)
        return (f"Task: {self._task_desc}\n\n{self._format_observation(self._current_obs or '')}\n\n"
                "What would you like to do?")

    def get_interaction_name(self) -> str:
        return "alfworld"
