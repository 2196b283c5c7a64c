"""`scienceworld`: multi-turn text-agent tasks in ScienceWorld (Wang et al., EMNLP 2022,
arXiv 2203.07540), a text simulator of elementary-school science experiments.

The model reads the task description and the room it stands in, then answers with one
action command a turn ("go to kitchen", "focus on dove egg", "move egg to red box");
ScienceWorld's score (0..100, partial credit for sub-goals) is the reward.

Needs the `scienceworld` package (PyPI; it ships the simulator jar and starts it with
py4j) and a Java runtime (Debian: `default-jre-headless`). Each simulator is a JVM
(about 2 s to start, 100-250 MB): this process keeps a small pool of them and an
episode borrows one for each call only. An episode records the commands it sent, so a
simulator that served another episode in between is brought back to this episode's
state by reloading the variation and replaying them (ScienceWorld is deterministic for
a task, variation and command sequence; a replay costs about 10 ms a command). The pool
holds at most `OPENTINKER_SCIENCEWORLD_JVMS` simulators (default 4), an operator
setting of the envhost process, never a job's.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import random
import shutil
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from opentinker.environment.base_game import AbstractGame, StepResult

#: the default tasks: ScienceWorld's "Classification" topic (tasks 4-1..4-4), the ones
#: its baseline agents score best on (paper, Table 2)
DEFAULT_TASKS = ("find-living-thing", "find-non-living-thing", "find-plant", "find-animal")
#: ScienceWorld's simplifications (ScienceWorldEnv.get_possible_simplifications, plus
#: "easy" = all of them), listed here so that env_args are checked without a JVM
SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors",
                   "noElectricalAction")
SPLITS = {"train": "train", "dev": "dev"}  # any other split (test, eval, ...) uses "test"
INVALID = "No known action matches that input."
AMBIGUOUS = "Ambiguous request"
HINT_EXAMPLES = 6  # valid actions shown after an invalid one (or every turn, show_valid_actions)
JVMS_ENV = "OPENTINKER_SCIENCEWORLD_JVMS"

log = logging.getLogger("opentinker.envhost.scienceworld")


def _scienceworld():
    """The `scienceworld` package. Raises RuntimeError naming what to install."""
    try:
        import scienceworld
    except ImportError as e:
        raise RuntimeError("the scienceworld env needs the `scienceworld` package: "
                           "pip install scienceworld (or opentinker[envs])") from e
    quiet = logging.getLogger("scienceworld")
    if quiet.level == logging.NOTSET:  # it logs every load at INFO, and a replay is a load
        quiet.setLevel(logging.WARNING)
    return scienceworld


def task_names() -> list[str]:
    """ScienceWorld's 30 task names in its own order (tasks 1-1 .. 10-2), read from the
    package's tasks.json (no JVM)."""
    _scienceworld()
    from scienceworld.constants import ID2TASK
    from scienceworld.utils import infer_task

    return [infer_task(t) for t in ID2TASK.values()]


def resolve_tasks(task: Any) -> tuple[str, ...]:
    """The task names `task` stands for: a name ("find-plant"), a task id ("4-3"), the
    paper's name ("Classification Find a plant"), an index into task_names(), "all", or
    a non-empty list of these. Raises ValueError naming env_args.task."""
    names = task_names()
    items = task if isinstance(task, (list, tuple)) else [task]
    if not items:
        raise ValueError("env_args.task: the list is empty")
    from scienceworld.utils import infer_task

    out: list[str] = []
    for t in items:
        if t == "all":
            out.extend(names)
        elif isinstance(t, int) and not isinstance(t, bool):
            if not 0 <= t < len(names):
                raise ValueError(f"env_args.task: index {t} is outside 0..{len(names) - 1}")
            out.append(names[t])
        elif isinstance(t, str) and infer_task(t) in names:
            out.append(infer_task(t))
        else:
            raise ValueError(f"env_args.task: {t!r} is not a ScienceWorld task (a name such as "
                             f"'find-plant', an id such as '4-3', or an index); known: {', '.join(names)}")
    return tuple(dict.fromkeys(out))  # unique, in order


def check_simplification(simplification: Any, tasks: tuple[str, ...]) -> str:
    """`simplification` checked: comma-separated names from SIMPLIFICATIONS (or "").
    Raises ValueError naming env_args.simplification."""
    if not isinstance(simplification, str):
        raise ValueError(f"env_args.simplification: must be a string, got {simplification!r}")
    for s in simplification.split(","):
        if s and s not in SIMPLIFICATIONS:
            raise ValueError(f"env_args.simplification: unknown {s!r}; choose from {', '.join(SIMPLIFICATIONS)} "
                             "(comma-separated, no spaces)")
    electrical = [t for t in tasks if "power-component" in t or "conductivity" in t]
    if electrical and "noElectricalAction" in simplification:
        raise ValueError(f"env_args.simplification: noElectricalAction makes {electrical[0]} impossible")
    return simplification


class _Sim:
    """One simulator (a JVM) and the state it holds: (episode key, commands replayed)."""

    def __init__(self) -> None:
        if shutil.which("java") is None:
            raise RuntimeError("the scienceworld env needs a Java runtime on PATH "
                               "(Debian: apt-get install default-jre-headless)")
        self.env = _scienceworld().ScienceWorldEnv("")
        self.owner: tuple[int, int] | None = None

    def close(self) -> None:
        self.env.close()


class _Pool:
    """The process's simulators; a caller holds one only for the length of one call.

    An idle simulator that already holds the caller's episode is preferred, then the
    one idle longest. Raises RuntimeError if a simulator cannot start.
    """

    def __init__(self) -> None:
        self._idle: list[_Sim] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False
        atexit.register(self.close)

    @staticmethod
    def capacity() -> int:
        raw = os.environ.get(JVMS_ENV, "4")
        if not raw.isdigit() or int(raw) < 1:
            raise RuntimeError(f"{JVMS_ENV}: must be an integer >= 1, got {raw!r}")
        return int(raw)

    @contextmanager
    def lease(self, key: int | None = None) -> Iterator[_Sim]:
        sim: _Sim | None = None
        with self._cond:
            while True:
                if self._idle:
                    sim = next((s for s in self._idle if s.owner and s.owner[0] == key), self._idle[0])
                    self._idle.remove(sim)
                    break
                if self._count < self.capacity():
                    self._count += 1
                    break
                self._cond.wait()
        if sim is None:
            try:
                sim = _Sim()
            except BaseException:
                with self._cond:
                    self._count -= 1
                    self._cond.notify()
                raise
        try:
            yield sim
        except BaseException:
            # the JVM may be broken or half-way through a replay: replace it
            with self._cond:
                self._count -= 1
                self._cond.notify()
            try:
                sim.close()
            except Exception as e:  # already dead: nothing more to free
                log.debug("closing a broken ScienceWorld simulator: %s", e)
            raise
        with self._cond:
            self._idle.append(sim)
            self._cond.notify()

    def close(self) -> None:
        """Stop every idle simulator (at exit; py4j also ends a JVM whose parent exits)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for sim in idle:
            sim.close()


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()
_VARIATIONS: dict[str, dict[str, list[int]]] = {}
_KEYS = itertools.count(1)


def pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _Pool()
        return _POOL


def variations(task: str) -> dict[str, list[int]]:
    """ScienceWorld's own train/dev/test variation split of `task` (disjoint lists of
    variation indices, from the simulator; cached), and "all" of them."""
    if task not in _VARIATIONS:
        with pool().lease() as sim:
            sim.owner = None
            sim.env.load(task, 0, "")
            _VARIATIONS[task] = {"train": sim.env.get_variations_train(),
                                 "dev": sim.env.get_variations_dev(),
                                 "test": sim.env.get_variations_test(),
                                 "all": list(range(sim.env.get_max_variations(task)))}
    return _VARIATIONS[task]


def max_variations(task: str) -> int:
    """How many variations ScienceWorld has of `task`."""
    return len(variations(task)["all"])


def parse_action(text: str) -> str:
    """The command in the model's reply: its first non-empty line, without an
    "Action:" prefix, quotes, backticks, a leading ">" or a trailing period."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    if line.lower().startswith("action:"):
        line = line[len("action:"):].strip()
    line = line.lstrip(">").strip().strip("`'\"").strip()
    return line[:-1].strip() if line.endswith(".") else line


class ScienceWorldGame(AbstractGame):
    """One ScienceWorld task variation per episode, one action command per turn.

    State (per GRPO group, from the seed): a task drawn from env_args.task and one of
    ScienceWorld's own variations of it for the split ("train" -> its train
    variations, "dev" -> dev, any other split -> test), so training never sees a test
    variation. The 4 default tasks have 75 test variations each, 300 in all.

    Reward: ScienceWorld's score is 0..100 and cumulative; each turn's reward is the
    change in score / 100, so an episode's reward is its final score / 100. The points
    ScienceWorld gives at the start (the first "look around") come with the first turn.
    A failed task (ScienceWorld sets the score to -100, e.g. after focusing on a wrong
    object) ends the episode and counts as score 0: the failing turn's reward takes
    back the points gained so far. info["score"] is the score so counted (0..100),
    info["raw_score"] ScienceWorld's own.

    Actions as ScienceWorld's agents use them (scienceworld.ScienceWorldEnv.step): the
    first line of the reply is the command; one ScienceWorld does not know ("No known
    action matches that input.") costs the turn and is answered with the action
    templates and some valid actions here; an ambiguous one takes ScienceWorld's first
    reading and says which.

    env_args:
      task:               task name, id ("4-1"), index, "all", or a list (default: the
                          four "find" tasks)
      simplification:     ScienceWorld simplifications, comma-separated (default "easy",
                          as in the paper's baselines: teleport, open doors/containers,
                          self-watering pots, no electrical actions)
      max_turns:          turns before the episode ends (default 30)
      show_valid_actions: list some valid actions after every observation (default False)
    """

    name = "scienceworld"

    def __init__(self, task: Any = DEFAULT_TASKS, simplification: str = "easy", max_turns: int = 30,
                 show_valid_actions: bool = False):
        super().__init__(task=task, simplification=simplification, max_turns=max_turns,
                         show_valid_actions=show_valid_actions)
        self.tasks = resolve_tasks(task)
        self.simplification = check_simplification(simplification, self.tasks)
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or not 1 <= max_turns <= 1000:
            raise ValueError(f"env_args.max_turns: must be an integer in 1..1000, got {max_turns!r}")
        if not isinstance(show_valid_actions, bool):
            raise ValueError(f"env_args.show_valid_actions: must be true or false, got {show_valid_actions!r}")
        self.max_turns, self.show_valid_actions = max_turns, show_valid_actions
        self.key = next(_KEYS)
        self.task, self.variation, self.turn, self.credited = "", 0, 0, 0
        self.commands: list[str] = []  # every command sent to the simulator, for replay
        self.description, self.templates = "", []

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        rng = random.Random(f"scienceworld:{split}:{seed}")
        task = rng.choice(self.tasks)
        return {"task": task, "variation": rng.choice(variations(task)[SPLITS.get(split, "test")])}

    def _replay(self, sim: _Sim) -> str:
        """Load this episode's variation on `sim` and replay its commands; returns the
        first observation."""
        env = sim.env
        sim.owner = None
        env.load(self.task, self.variation, self.simplification)
        env.server.reset()  # as ScienceWorldEnv.reset: reset, then a first "look around"
        first = env.server.step("look around")
        for c in self.commands:
            env.server.step(c)
        sim.owner = (self.key, len(self.commands))
        return first

    @contextmanager
    def _sim(self) -> Iterator[_Sim]:
        with pool().lease(self.key) as sim:
            if sim.owner != (self.key, len(self.commands)):
                self._replay(sim)
            yield sim
            sim.owner = (self.key, len(self.commands))

    def reset(self, task: str = "", variation: int = 0, seed: int | None = None) -> str:
        if not task:
            return self.reset(**self.generate_initial_state(seed or 0))
        if task not in self.tasks:
            raise ValueError(f"task: {task!r} is not among env_args.task ({', '.join(self.tasks)})")
        if not isinstance(variation, int) or variation < 0:
            raise ValueError(f"variation: must be an integer >= 0, got {variation!r}")
        n = max_variations(task)
        if variation >= n:
            raise ValueError(f"variation: {variation} is outside 0..{n - 1} for task {task}")
        self.task, self.variation, self.turn, self.credited, self.commands = task, variation, 0, 0, []
        with pool().lease(self.key) as sim:
            first = self._replay(sim)
            self.description = sim.env.get_task_description()
            self.templates = sim.env.get_possible_actions()
            extra = self._valid_list(sim) if self.show_valid_actions else ""
        return first.strip() + extra

    def get_system_prompt(self) -> str:
        return ("You are an agent in ScienceWorld, a text-based science simulator. Each turn, reply with "
                "exactly one action command on a single line and nothing else, for example: look around, "
                "go to kitchen, open door to outside, pick up thermometer, focus on dove egg, "
                "move dove egg to red box. Use 'focus on' only for the object the task is about: "
                "focusing on a wrong object fails the task.")

    def get_initial_user_message(self) -> str:
        templates = ", ".join(t for t in self.templates if t)
        return f"{self.description}\n\nAction templates (OBJ is an object you can see): {templates}"

    def _valid_list(self, sim: _Sim) -> str:
        valid = sorted(set(sim.env.get_valid_action_object_combinations()))
        # a fixed sample per state: the same state always shows the same examples
        shown = random.Random(f"{self.task}:{self.variation}:{len(self.commands)}").sample(
            valid, min(HINT_EXAMPLES, len(valid)))
        return "\nSome valid actions here: " + "; ".join(shown) if shown else ""

    def step(self, action: str) -> StepResult:
        self.turn += 1
        command = parse_action(action)
        with self._sim() as sim:
            server = sim.env.server
            if command:
                self.commands.append(command)
                obs = server.step(command)
            else:
                obs = INVALID
            if obs.startswith(AMBIGUOUS):
                options = [ln.split("\t", 1)[-1] for ln in obs.splitlines()[1:] if ln.strip()]
                self.commands.append("0")
                obs = f"(Ambiguous; took: {options[0] if options else command})\n{server.step('0')}"
            valid = not obs.startswith(INVALID)
            raw = int(round(100 * server.getScore()))  # as ScienceWorldEnv.step: 0..1 -> 0..100
            won = bool(server.getCompleted()) and raw >= 100
            failed = raw < 0
            moves = int(server.getNumMoves())
            if not valid:
                # short: the templates are in the first message, and this repeats every bad turn
                obs = (f"{INVALID} Reply with one command built from the action templates "
                       "(e.g. look around, go to OBJ, pick up OBJ, focus on OBJ, move OBJ to OBJ).") \
                    + self._valid_list(sim)
            elif self.show_valid_actions:
                obs += self._valid_list(sim)
            done = bool(server.getCompleted()) or failed or self.turn >= self.max_turns
        score = 0 if failed else raw
        reward, self.credited = (score - self.credited) / 100.0, score
        if failed:
            obs += "\n(The task has failed.)"
        elif won:
            obs += "\n(Task completed.)"
        info = {"turn": self.turn, "action": command, "valid": valid, "score": score, "raw_score": raw,
                "won": won, "failed": failed, "moves": moves, "task": self.task, "variation": self.variation}
        return StepResult(obs.strip(), reward, done, info)

    def get_state(self) -> dict[str, Any]:
        return {"task": self.task, "variation": self.variation, "turn": self.turn, "score": self.credited,
                "commands": list(self.commands)}
