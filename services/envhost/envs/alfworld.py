"""`alfworld`: multi-turn household tasks in ALFWorld's text games (Shridhar et al.,
ICLR 2021, arXiv 2010.03768), the TextWorld side of the ALFRED benchmark.

The model reads the room and its task ("-= Welcome to TextWorld, ALFRED! =- ... Your
task is to: put some apple on fridge."), then answers with one command a turn ("go to
fridge 1", "take apple 1 from countertop 1", "move apple 1 to fridge 1"); reward 1.0
on the turn the task is done (ALFWorld's success), 0.0 otherwise.

Data: the operator's, never a job's. The envhost reads ALFWorld's games where ALFWorld
itself does: the folder in the envhost process's `ALFWORLD_DATA` environment variable
(default ~/.cache/alfworld, as `alfworld.info`), filled on a machine with internet by
the package's `alfworld-download`. Inside it, `json_2.1.1/<split>/<task>/<trial>/`
holds `traj_data.json` and `game.tw-pddl` (PDDL domain, problem and grammar in one
JSON file). Splits: "train" -> json_2.1.1/train; "test" (and "valid_unseen") ->
json_2.1.1/valid_unseen, the paper's unseen (out-of-distribution) evaluation set, which
ALFWorld's config calls eval_ood (134 games in ALFWorld's release: the benchmark's own
size, under 200); "valid_seen" -> json_2.1.1/valid_seen.

Loading is ALFWorld's own (alfworld.agents.environment.alfred_tw_env, package 0.4.2):
the games of a split are those `AlfredTWEnv.collect_game_files` keeps (solvable, of
the chosen task types, no movable/sliced), and a game plays in the environment stack
`AlfredTWEnv.init_env` builds per batch slot: TextWorld's GenericEnvironment (the PDDL
backend for .tw-pddl) wrapped in `AlfredDemangler` (object ids -> "apple 1") and
`AlfredInfos`, asked for `EnvInfos(won=True, admissible_commands=True)`. A command
that is not admissible gets ALFWorld's "Nothing happens." and costs the turn.

Each game stack holds its own copy of Fast Downward's library (tens of MB, loaded by
TextWorld's PddlEnv): this process keeps the stacks of finished episodes and reuses
them for new games, as ALFWorld's batch env does, so their number stays at the most
episodes ever open at once. TextWorld's PDDL games share module-global parsers, so one
envhost process plays one game call (load, reset or step) at a time: run more envhost
processes for more throughput, as ALFWorld runs its batch envs in subprocesses.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import weakref
from pathlib import Path
from typing import Any

from opentinker.environment.alfworld.textworld_envs import TEXTWORLD_LOCK, EnvPool
from opentinker.environment.base_game import AbstractGame, StepResult

#: ALFWorld's six task types, numbered as its config's env.task_types
#: (alfworld.agents.environment.alfred_tw_env.TASK_TYPES)
TASK_TYPES = {1: "pick_and_place_simple", 2: "look_at_obj_in_light", 3: "pick_clean_then_place_in_recep",
              4: "pick_heat_then_place_in_recep", 5: "pick_cool_then_place_in_recep", 6: "pick_two_obj_and_place"}
#: split -> (folder under json_2.1.1, AlfredTWEnv's train_eval name for it)
SPLITS = {"train": ("train", "train"), "test": ("valid_unseen", "eval_out_of_distribution"),
          "valid_unseen": ("valid_unseen", "eval_out_of_distribution"),
          "valid_seen": ("valid_seen", "eval_in_distribution")}
DATA_ENV = "ALFWORLD_DATA"
NOTHING = "Nothing happens."

log = logging.getLogger("opentinker.envhost.alfworld")


def _alfred_tw_env():
    """ALFWorld's TextWorld module. Raises RuntimeError naming what to install."""
    try:
        from alfworld.agents.environment import alfred_tw_env
    except ImportError as e:
        raise RuntimeError("the alfworld env needs the `alfworld` package (it brings textworld): "
                           "pip install alfworld (or opentinker[envs])") from e
    return alfred_tw_env


def data_root() -> Path:
    """The ALFWorld data folder of this process: $ALFWORLD_DATA, else ALFWorld's default
    ~/.cache/alfworld (alfworld.info)."""
    return Path(os.environ.get(DATA_ENV) or os.path.expanduser("~/.cache/alfworld"))


def resolve_task_types(task_types: Any) -> tuple[int, ...]:
    """`task_types` as ALFWorld's type numbers: "all", or a non-empty list of numbers
    (1..6) and names ("pick_and_place_simple"). Raises ValueError naming env_args.task_types."""
    if task_types == "all":
        return tuple(TASK_TYPES)
    if not isinstance(task_types, (list, tuple)) or not task_types:
        raise ValueError(f"env_args.task_types: must be \"all\" or a non-empty list, got {task_types!r}")
    by_name = {v: k for k, v in TASK_TYPES.items()}
    out = []
    for t in task_types:
        if isinstance(t, int) and not isinstance(t, bool) and t in TASK_TYPES:
            out.append(t)
        elif isinstance(t, str) and t in by_name:
            out.append(by_name[t])
        else:
            known = ", ".join(f"{k} {v}" for k, v in TASK_TYPES.items())
            raise ValueError(f"env_args.task_types: {t!r} is not an ALFWorld task type ({known})")
    return tuple(sorted(set(out)))


_games: dict[tuple[str, str, tuple[int, ...]], list[str]] = {}
_games_lock = threading.Lock()


def list_games(split: str, task_types: tuple[int, ...]) -> list[str]:
    """The games of `split`, as paths relative to data_root(), sorted; the folder is
    walked once per process (AlfredTWEnv reads every game file, seconds for the full
    data). Raises ValueError for an unknown split, FileNotFoundError saying how to get
    the data when the split's folder is missing or holds no playable game."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
    root = data_root().resolve()
    folder, train_eval = SPLITS[split]
    key = (str(root), folder, task_types)
    with _games_lock:
        if key not in _games:
            where = root / "json_2.1.1" / folder
            hint = (f"The envhost reads ALFWorld's games from ${DATA_ENV} (now {root}). On a machine "
                    f"with internet run `alfworld-download` (from `pip install alfworld`), copy the folder "
                    f"to this host and start the envhost with {DATA_ENV}=<that folder>.")
            if not where.is_dir():
                raise FileNotFoundError(f"ALFWorld data not found: {where} does not exist. {hint}")
            config = {"env": {"goal_desc_human_anns_prob": 0, "task_types": list(task_types)},
                      "dataset": {"data_path": str(where), "eval_ood_data_path": str(where),
                                  "eval_id_data_path": str(where), "num_train_games": -1, "num_eval_games": -1}}
            env = _alfred_tw_env().AlfredTWEnv(config, train_eval=train_eval)
            # os.walk's order is the filesystem's: sort, so a seed picks the same game anywhere
            games = sorted(Path(f).relative_to(root).as_posix() for f in env.game_files)
            if not games:
                kinds = ", ".join(TASK_TYPES[t] for t in task_types)
                raise FileNotFoundError(f"ALFWorld data: no solvable game of types {kinds} under {where}. {hint}")
            log.info("alfworld: %d games in %s", len(games), where)
            _games[key] = games
        return _games[key]


def _new_stack() -> Any:
    """A game stack as AlfredTWEnv.init_env makes one per batch slot (without the gym
    Filter/Limit: this class counts turns)."""
    import textworld
    from textworld.envs.wrappers import GenericEnvironment

    tw = _alfred_tw_env()
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    return tw.AlfredInfos(tw.AlfredDemangler(GenericEnvironment(infos), shuffle=False))


_stacks = EnvPool(_new_stack)


def parse_action(text: str) -> str:
    """The command in the model's reply: its first non-empty line, without an
    "Action:" prefix, quotes, backticks, a leading ">" or a trailing period, lower-cased
    with single spaces (ALFWorld's commands are all lower case)."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    if line.lower().startswith("action:"):
        line = line[len("action:"):].strip()
    line = line.lstrip(">").strip().strip("`'\"").strip()
    if line.endswith("."):
        line = line[:-1]
    return " ".join(line.lower().split())


class AlfWorldGame(AbstractGame):
    """One ALFWorld game per episode, one text command per turn.

    State (per GRPO group, from the seed): a game of the split drawn from the games of
    env_args.task_types ("train" -> train games, "test" -> valid_unseen), so training
    never sees an evaluation game. `reset` plays only games found in the operator's data.

    Observation: ALFWorld's feedback; with env_args.admissible_commands, followed by the
    commands valid in the new state, as ALFWorld's `admissible_commands` info gives them.
    Reward: 1.0 on the turn ALFWorld reports the game won (done), else 0.0; the episode
    also ends after env_args.max_turns commands. info: turn, command, admissible (whether
    the command was valid), won, game (its path under $ALFWORLD_DATA).

    env_args:
      task_types:          "all" (default) or a list of ALFWorld task types, numbers 1..6
                           or names (1 pick_and_place_simple, 2 look_at_obj_in_light,
                           3 pick_clean_then_place_in_recep, 4 pick_heat_then_place_in_recep,
                           5 pick_cool_then_place_in_recep, 6 pick_two_obj_and_place)
      max_turns:           commands before the episode ends (default 50, ALFWorld's
                           evaluation budget)
      admissible_commands: list the valid commands after each observation (default true)
    """

    name = "alfworld"

    def __init__(self, task_types: Any = "all", max_turns: int = 50, admissible_commands: bool = True):
        super().__init__(task_types=task_types, max_turns=max_turns, admissible_commands=admissible_commands)
        self.task_types = resolve_task_types(task_types)
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or not 1 <= max_turns <= 1000:
            raise ValueError(f"env_args.max_turns: must be an integer in 1..1000, got {max_turns!r}")
        if not isinstance(admissible_commands, bool):
            raise ValueError(f"env_args.admissible_commands: must be true or false, got {admissible_commands!r}")
        self.max_turns, self.show_admissible = max_turns, admissible_commands
        self.game, self.turn, self.won = "", 0, False
        self.admissible: list[str] = []
        self._stack: Any = None
        self._release: Any = None

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"game", "split"}: a game of `split` chosen by `seed` (a path relative to the
        data folder). Raises as list_games."""
        games = list_games(split, self.task_types)
        return {"game": random.Random(f"alfworld:{split}:{seed}").choice(games), "split": split}

    def reset(self, game: str = "", split: str = "train", seed: int | None = None) -> str:
        """Load `game` and return ALFWorld's first observation (the room and the task).
        Raises ValueError if `game` is not a game of `split` under env_args.task_types."""
        if not game:
            return self.reset(**self.generate_initial_state(seed or 0, split))
        if game not in list_games(split, self.task_types):
            raise ValueError(f"game: {game!r} is not an ALFWorld game of split {split!r} and "
                             f"env_args.task_types in the envhost's data")
        self._close()
        stack = _stacks.borrow()
        # an episode dropped without finishing (closed, expired) returns its stack when collected
        self._release = weakref.finalize(self, _stacks.give_back, stack)
        self._stack = stack
        with TEXTWORLD_LOCK:
            stack.load(str(data_root().resolve() / game))
            state = stack.reset()
        self.game, self.turn, self.won = game, 0, False
        self.admissible = list(state["admissible_commands"] or [])
        return self._observe(state.feedback)

    def _observe(self, feedback: str) -> str:
        text = str(feedback).strip()
        if self.show_admissible and self.admissible:
            text += "\n\nAdmissible commands: " + ", ".join(self.admissible) + "."
        return text

    def _close(self) -> None:
        if self._release is not None:
            self._release()  # the stack goes back to the pool (once)
        self._stack, self._release = None, None

    def get_system_prompt(self) -> str:
        return ("You are an agent in a household, played as a text game (ALFWorld). Each turn, reply with "
                "exactly one command on a single line and nothing else, for example: go to countertop 1, "
                "open fridge 1, take apple 1 from countertop 1, move apple 1 to fridge 1, heat apple 1 with "
                "microwave 1, use desklamp 1, look, inventory.")

    def get_initial_user_message(self) -> str:
        return "Complete the task below. Reply with one command per turn."

    def step(self, action: str) -> StepResult:
        """Send the reply's command to the game. Raises RuntimeError if the episode was
        not reset or has ended."""
        if self._stack is None:
            raise RuntimeError("step: the episode is not running (reset first; it ends when done)")
        self.turn += 1
        command = parse_action(action)
        valid = command in self.admissible
        # TextWorld answers a command it does not know with "Nothing happens." and no change
        with TEXTWORLD_LOCK:
            state, _, _ = self._stack.step(command)
        self.won = bool(state["won"])
        self.admissible = list(state["admissible_commands"] or [])
        done = self.won or self.turn >= self.max_turns
        obs = str(state.feedback).strip()
        if done:
            self._close()
            self.admissible = []
        info = {"turn": self.turn, "command": command, "admissible": valid, "won": self.won, "game": self.game}
        return StepResult(self._observe(obs), 1.0 if self.won else 0.0, done, info)

    def get_state(self) -> dict[str, Any]:
        return {"game": self.game, "turn": self.turn, "won": self.won, "admissible_commands": list(self.admissible)}

