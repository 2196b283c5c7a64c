"""`swe`: software engineering. The policy fixes an issue in a repository with tools,
and the hidden tests grade the result, as in SWE-Gym (Pan et al. 2024, arXiv
2412.21139) and upstream OpenTinker's open issue #17.

An episode: the first user message is the issue and the repository's file list. Each
turn the policy sends one command (the first one in its reply), as plain text or as a
tool call (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, get_tools()):

    read_file <path> [<first>-<last>]     a file (or some of its lines; a folder: its files)
    edit <path>                           search/replace blocks (swe_patch.parse_blocks)
    <<<<<<< SEARCH
    ...
    =======
    ...
    >>>>>>> REPLACE
    apply_patch                           a unified diff follows (fences allowed); a reply
    --- a/<path> ...                      that is only a diff is applied as one too
    run_tests [<path>]                    the repository's tests (or one file) in the sandbox
    submit                                end the episode and be graded

Rewards, on the last turn only (0 before):
- graded (after `submit`, or after the `max_turns`-th reply whatever it was): the
  fraction of the hidden tests (FAIL_TO_PASS and PASS_TO_PASS) that pass, in [0, 1];
  info `resolved` is whether all do.
- PATCH_FAILED_REWARD (-0.2), ending the episode at once, for an `edit` or
  `apply_patch` that does not apply: a path that is absolute, holds `..` or `.git`, or
  leads out of the repository through a symlink; a missing file; an edit without a
  well-formed SEARCH/REPLACE block, whose SEARCH text is not in the file or is in it
  more than once, or whose empty SEARCH would create a file that exists; a diff that
  does not parse, whose hunks do not match, that creates an existing file or changes a
  missing one, renames, or is binary; a result over swe_patch.MAX_FILE_BYTES.
A reply with no command, an unknown tool, or a `read_file` / `run_tests` that cannot
be done (missing file, refused path) costs the turn and says why.

Grading (SWE-bench's procedure): in the episode's copy, every file of a hidden test
(and every file the task's test_patch touches) is put back as the snapshot had it, the
test_patch is applied, and those test files run in the sandbox (swe_runner), within
`timeout_s`; a test that did not report passing (failed, errored, or still running when
the sandbox killed the run) counts as failed.

Each episode works on its own copy of the snapshot in a temporary folder this env
owns, removed when the episode ends, when the env is reset again, or when the envhost
drops the episode (weakref.finalize). The policy's text never runs on the host: edits
are text operations on checked paths (swe_patch), and the repository's code runs only
in the sandbox (no network, no host files, limits on time, CPU, memory, processes,
file size and output).

Tasks (swe_tasks): by default 40 generated repositories with a planted bug; with
`data_dir`, SWE-Gym-format instances. Held out: `splits.HeldOut` over the task ids (40
generated tasks: 8 test).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost import sandbox
from opentinker.services.envhost.envs.splits import HeldOut, check_split
from opentinker.services.envhost.envs.swe_patch import PatchError, apply_patch, edit_file, parse_blocks, \
    parse_patch, read_text, resolve
from opentinker.services.envhost.envs.swe_runner import RUNNERS, SKIP_NAMES, Suite, run_suites
from opentinker.services.envhost.envs.swe_tasks import Task, generate_tasks, load_swe_gym
from opentinker.services.envhost.envs.toolcall import TOOL_CALL, parse_call

PATCH_FAILED_REWARD = -0.2
REWARDS = ("fraction", "resolved")  # env_args.reward (SWEGame)
COMMANDS = ("read_file", "edit", "apply_patch", "run_tests", "submit")
#: files named in the first user message (the rest are counted)
MAX_LISTED_FILES = 200
MAX_ISSUE_CHARS = 8000
MAX_TURNS = 64
MAX_MEMORY_MB = 8192
_COMMAND = re.compile(r"^(read_file|edit|apply_patch|run_tests|submit)\b:?[ \t]*(.*)$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_DIST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def _tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


_PATH = {"type": "string", "description": "a path relative to the repository root"}
TOOLS = [
    _tool("read_file", "Show a file of the repository (or some of its lines; a folder: its files).",
          {"path": _PATH, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}, ["path"]),
    _tool("edit", "Replace text that occurs exactly once in a file (an empty search creates a new file). "
                  "An edit that does not apply ends the episode with reward -0.2.",
          {"path": _PATH, "search": {"type": "string", "description": "lines copied exactly from the file"},
           "replace": {"type": "string", "description": "the lines to put in their place"}},
          ["path", "search", "replace"]),
    _tool("apply_patch", "Apply a unified diff (paths relative to the repository root). A patch that does "
                         "not apply ends the episode with reward -0.2.",
          {"patch": {"type": "string", "description": "the unified diff"}}, ["patch"]),
    _tool("run_tests", "Run the repository's tests (or one test file) and show their output.",
          {"path": {"type": "string", "description": "a test file (optional)"}}, []),
    _tool("submit", "End the episode; the hidden tests then decide the reward.", {}, []),
]


def parse_command(text: str) -> tuple[str, dict[str, Any], str]:
    """The first command of a reply (module docstring): (name, arguments, "") or ("", {},
    why there is none). Arguments: read_file {path, start_line?, end_line?}; edit {path,
    blocks: the text after the command line} or, from a tool call, {path, search, replace};
    apply_patch {patch}; run_tests {path?}; submit {}."""
    calls = TOOL_CALL.findall(text)
    if calls:
        name, args, err = parse_call(calls[0])
        if err:
            return "", {}, err
        if name not in COMMANDS:
            return "", {}, f"unknown tool {name!r}: the tools are {', '.join(COMMANDS)}"
        return name, args, ""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = _COMMAND.match(line.strip().strip("`").strip())
        if not m:
            continue
        name, rest = m.group(1), m.group(2).strip().strip("`").strip()
        after = "\n".join(lines[i + 1:])
        if name == "read_file":
            parts = rest.split()
            args: dict[str, Any] = {"path": parts[0] if parts else ""}
            if len(parts) > 1:
                r = _RANGE.match(parts[1])
                if not r or len(parts) > 2:
                    return "", {}, "read_file takes a path and optionally a line range such as 10-40"
                args["start_line"] = int(r.group(1))
                args["end_line"] = int(r.group(2) or r.group(1))
            return name, args, ""
        if name == "edit":
            return name, {"path": rest.split()[0] if rest else "", "blocks": after}, ""
        if name == "apply_patch":
            return name, {"patch": _unfence(after if after.strip() else rest)}, ""
        if name == "run_tests":
            return name, ({"path": rest} if rest else {}), ""
        return name, {}, ""
    if re.search(r"^--- \S.*\n\+\+\+ \S", text, re.M):
        return "apply_patch", {"patch": _unfence(text)}, ""
    return "", {}, "no command found"


def _unfence(text: str) -> str:
    return "\n".join(line for line in text.split("\n") if not line.lstrip().startswith("```")) + "\n"


@functools.lru_cache(maxsize=16)
def _held_out(ids: tuple[str, ...]) -> HeldOut:
    return HeldOut(task_key(i) for i in ids)


def task_key(task_id: str) -> str:
    """The canonical key of a task (splits.py)."""
    return f"swe:{task_id}"


def _int_arg(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"env_args.{name}: must be an integer in {lo}..{hi}, got {value!r}")
    return value


class SWEGame(AbstractGame):
    """Fix an issue in a repository with tools (module docstring).

    env_args:
      data_dir:         a SWE-Gym-format folder (swe_tasks; default: the generated tasks)
      max_turns:        the policy's replies before grading, 1..64 (default 8); keep the
                        job's sampling.max_turns at least this, or an episode cut short
                        by the rollout goes ungraded
      timeout_s:        wall clock of one test run (run_tests, grading), seconds, (0, 600]
                        (default 30)
      memory_mb:        address space of a test run, MiB, 64..8192 (default 1024)
      disk_mb:          the sandbox's /work tmpfs (the repository is copied there), MiB,
                        16..8192 (default 256)
      runner:           "unittest" or "pytest" (default: the task's; generated tasks use
                        unittest, SWE-Gym data pytest)
      packages:         more installed distributions to make importable in the sandbox
                        (the repository's dependencies), e.g. ["numpy"]
      max_output_chars: run_tests output kept (the middle is cut), 500..100000 (default 4000)
      max_read_chars:   read_file text shown per call, 500..100000 (default 6000)
      reward:           "fraction": the fraction of the hidden tests that pass (default);
                        "resolved": 1 when every one passes, else 0 (SWE-bench's resolved
                        rate, Jimenez et al. 2024, arXiv 2310.06770: an unchanged
                        repository earns nothing for its PASS_TO_PASS tests)
    Raises ValueError naming the env_arg for a bad value or an unknown one, or `runner`
    when the pytest runner is asked for and pytest is not installed here.
    """

    name = "swe"

    def __init__(self, data_dir: str | None = None, max_turns: int = 8, timeout_s: float = 30.0,
                 memory_mb: int = 1024, disk_mb: int = 256, runner: str | None = None,
                 packages: list[str] | tuple[str, ...] = (), max_output_chars: int = 4000,
                 max_read_chars: int = 6000, reward: str = "fraction", **unknown: Any):
        super().__init__(data_dir=data_dir, max_turns=max_turns, timeout_s=timeout_s, runner=runner)
        for k in sorted(unknown):
            raise ValueError(f"env_args.{k}: not an argument of swe")
        self.max_turns = _int_arg("max_turns", max_turns, 1, MAX_TURNS)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            raise ValueError(f"env_args.timeout_s: must be a number in (0, 600], got {timeout_s!r}")
        if runner is not None and runner not in RUNNERS:
            raise ValueError(f"env_args.runner: must be one of {RUNNERS}, got {runner!r}")
        if not isinstance(packages, (list, tuple)) or len(packages) > 64 or \
                not all(isinstance(p, str) and _DIST.match(p) for p in packages):
            raise ValueError(f"env_args.packages: must be a list of distribution names, got {packages!r}")
        if reward not in REWARDS:
            raise ValueError(f"env_args.reward: must be one of {REWARDS}, got {reward!r}")
        self.runner, self.packages, self.reward = runner, tuple(packages), reward
        self.max_output_chars = _int_arg("max_output_chars", max_output_chars, 500, 100_000)
        self.max_read_chars = _int_arg("max_read_chars", max_read_chars, 500, 100_000)
        # CPU seconds a little above the wall clock, so a busy loop ends as "timed out"
        self.limits = sandbox.SandboxLimits(
            timeout_s=float(timeout_s), cpu_s=math.ceil(timeout_s) + 1,
            memory_mb=_int_arg("memory_mb", memory_mb, 64, MAX_MEMORY_MB),
            disk_mb=_int_arg("disk_mb", disk_mb, 16, 8192), max_open_files=256,
            max_output_chars=self.max_output_chars)
        self.tasks = load_swe_gym(data_dir) if data_dir else generate_tasks()
        if (runner or self.tasks[0].runner) == "pytest" and importlib.util.find_spec("pytest") is None:
            raise ValueError("env_args.runner: the pytest runner needs pytest installed on the envhost "
                             "(the `envs` extra)")
        self.by_id = {t.id: t for t in self.tasks}
        self.task: Task | None = None
        self.root: Path | None = None
        self._remove = None  # the finalizer that removes `root`
        self.turn = 0
        self.edits = 0

    # --- the group's state and the episode's start ------------------------------------

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"task": id}: a task of `split`, drawn from `seed`. Raises ValueError for a
        split other than "train" or "test"."""
        check_split(split)
        ids = tuple(self.by_id)
        return {"task": _held_out(ids).draw(self.rng(f"swe:{split}:{seed}"), lambda r: r.choice(ids),
                                            task_key, split)}

    def reset(self, task: str | None = None, seed: int | None = None) -> str:
        """Start on `task` (or the task of `seed`) in a fresh copy of its snapshot.
        Returns ""; the issue is the initial user message. Raises SandboxUnavailable when
        no test could run on this host (no bwrap), ValueError for an unknown task."""
        sandbox.check()
        if task is None:
            task = self.generate_initial_state(seed or 0)["task"]
        if task not in self.by_id:
            raise ValueError(f"task: {task!r} is not one of this env's tasks")
        self.close()
        self.task = self.by_id[task]
        self.root = Path(tempfile.mkdtemp(prefix="opentinker-swe-")).resolve()
        self._remove = weakref.finalize(self, shutil.rmtree, str(self.root), ignore_errors=True)
        if self.task.files is not None:
            for rel, text in self.task.files.items():
                path = self.root / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
        else:
            shutil.copytree(self.task.snapshot_dir, self.root, symlinks=True, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(*SKIP_NAMES), copy_function=_link_or_copy)
        self.turn, self.edits = 0, 0
        return ""

    def close(self) -> None:
        """Remove the episode's copy of the repository (also done when the episode ends)."""
        if self._remove is not None:
            self._remove()
            self._remove = None

    def get_system_prompt(self) -> str:
        return (
            "You fix bugs in a Python repository. Reply with exactly one command each turn:\n"
            "read_file <path> [<first line>-<last line>]   show a file\n"
            "edit <path>   then one or more blocks:\n"
            "<<<<<<< SEARCH\nlines copied exactly from the file\n=======\nthe new lines\n>>>>>>> REPLACE\n"
            "apply_patch   then a unified diff (--- a/<path>, +++ b/<path>, @@ hunks)\n"
            "run_tests [<path>]   run the tests\n"
            "submit   finish; hidden tests decide your reward\n"
            "Paths are relative to the repository root. An edit or patch that does not apply ends the "
            f"episode with reward {PATCH_FAILED_REWARD}. You have {self.max_turns} turns; after the last one "
            "the repository is graded as it is.")

    def get_initial_user_message(self) -> str:
        task = self.task
        if task is None:
            raise RuntimeError("reset the env first")
        issue = task.problem_statement.strip()
        if len(issue) > MAX_ISSUE_CHARS:
            issue = issue[:MAX_ISSUE_CHARS] + "\n[... the issue is cut here ...]"
        files = self._files()
        listed = "\n".join(files[:MAX_LISTED_FILES])
        if len(files) > MAX_LISTED_FILES:
            listed += f"\n[... and {len(files) - MAX_LISTED_FILES} more files; read_file <folder> lists one]"
        return (f"Fix this issue in the repository {task.repo or task.id}.\n\nIssue:\n{issue}\n\n"
                f"Files ({len(files)}):\n{listed}")

    def get_tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def get_privileged_context(self) -> str:
        """The reference fix, for a distillation teacher."""
        if self.task is None or not self.task.patch:
            return ""
        return f"A reference fix for this issue (a unified diff):\n{self.task.patch}"

    def get_state(self) -> dict[str, Any]:
        return {"task": self.task.id if self.task else None, "turn": self.turn, "edits": self.edits}

    # --- a turn -------------------------------------------------------------------------

    def step(self, action: str) -> StepResult:
        if self.task is None or self.root is None or self._remove is None:
            raise RuntimeError("the episode is not open: reset the env first")
        self.turn += 1
        name, args, error = parse_command(action)
        try:
            if not name:
                obs = f"{error}. Reply with one command: {', '.join(COMMANDS)} (see the system prompt)."
            elif name == "submit":
                return self._grade("submit", "Submitted.")
            elif name == "read_file":
                obs = self._read(args)
            elif name == "run_tests":
                obs = self._run_tests(args.get("path"))
            elif name == "edit":
                obs = self._edit(args)
            else:
                obs = apply_patch(self.root, _str_arg(args, "patch"))
                self.edits += 1
        except PatchError as e:
            return self._end(f"The change does not apply: {e}. The episode is over.", PATCH_FAILED_REWARD,
                             {"ended": "patch_failed", "error": str(e)})
        if self.turn >= self.max_turns:
            return self._grade("max_turns", f"{obs}\n\nThat was the last turn.")
        return StepResult(obs, 0.0, False, {"turn": self.turn, "command": name})

    def _edit(self, args: dict[str, Any]) -> str:
        path = _str_arg(args, "path")
        if "blocks" in args:
            blocks = parse_blocks(_str_arg(args, "blocks"))
        else:
            blocks = [(_str_arg(args, "search").rstrip("\n"), _str_arg(args, "replace").rstrip("\n"))]
        out = edit_file(self.root, path, blocks)
        self.edits += 1
        return out

    def _read(self, args: dict[str, Any]) -> str:
        rel = args.get("path")
        try:
            path = resolve(self.root, rel if isinstance(rel, str) else "")
            if path.is_dir():
                files = self._files(path)
                return f"{rel} holds {len(files)} files:\n" + "\n".join(files[:MAX_LISTED_FILES])
            text = read_text(path, rel)
        except PatchError as e:
            return f"read_file: {e}"
        lines = text.splitlines(keepends=True)
        first, last = args.get("start_line", 1), args.get("end_line", len(lines))
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (first, last)) or \
                not 1 <= first <= max(last, 1):
            return f"read_file: bad line range {first!r}-{last!r}"
        if lines and first > len(lines):
            return f"read_file: {rel} has only {len(lines)} lines"
        shown, size, end = [], 0, first - 1
        for line in lines[first - 1:last]:
            if size + len(line) > self.max_read_chars and shown:
                break
            shown.append(line[:self.max_read_chars])
            size += len(line)
            end += 1
        head = f"{rel} (lines {first}-{end} of {len(lines)}):\n" if (first, end) != (1, len(lines)) else f"{rel}:\n"
        body = "".join(shown) or "(empty)\n"
        if end < min(last, len(lines)):
            body += f"[... cut at {self.max_read_chars} characters; read on with: read_file {rel} {end + 1}-{last}]\n"
        return head + body

    def _run_tests(self, rel: Any) -> str:
        targets: tuple[str, ...] = ()
        if rel:
            try:
                if not isinstance(rel, str) or not resolve(self.root, rel.split("::")[0]).exists():
                    return f"run_tests: {rel}: no such file"
            except PatchError as e:
                return f"run_tests: {e}"
            targets = ("./" + rel if rel.startswith("-") else rel,)  # a path, never a runner option
        run = run_suites([Suite(self.root, targets)], self._runner(), self.limits, self.packages)
        return run.run.observation()

    def _runner(self) -> str:
        return self.runner or self.task.runner

    # --- the end ------------------------------------------------------------------------

    def _grade(self, ended: str, prefix: str) -> StepResult:
        task, root = self.task, self.root
        hidden = task.hidden_tests
        files = sorted({t.split("::")[0] for t in hidden if "::" in t})
        info: dict[str, Any] = {"ended": ended}
        try:
            touched = [fp.path for fp in parse_patch(task.test_patch)] if task.test_patch.strip() else []
            for rel in sorted(set(files) | set(touched)):
                _restore(root, rel, task.original(rel))
            if touched:
                apply_patch(root, task.test_patch)
        except (PatchError, OSError) as e:
            info["test_patch_error"] = str(e)
            return self._end(f"{prefix}\nThe hidden tests could not be set up ({e}); reward 0.", 0.0, info)
        targets = tuple(f for f in files if (root / f).is_file())
        limits = dataclasses.replace(self.limits, max_output_chars=4000 + 300 * len(hidden))
        run = run_suites([Suite(root, targets, report=True)], self._runner(), limits, self.packages)
        result = run.suites[0]
        passed = [t for t in hidden if result.passed.get(t)]
        failed = [t for t in hidden if not result.passed.get(t)]
        info.update(passed=len(passed), total=len(hidden), resolved=not failed, failed_tests=failed[:20],
                    timed_out=run.run.timed_out, finished=result.finished)
        obs = f"{prefix}\nHidden tests: {len(passed)} of {len(hidden)} passed."
        if not result.finished:
            note = run.note() or "[the test process ended before every test had run]"
            obs += f"\n{note} Tests that had not finished count as failed."
        return self._end(obs, float(not failed) if self.reward == "resolved" else len(passed) / len(hidden), info)

    def _end(self, obs: str, reward: float, info: dict[str, Any]) -> StepResult:
        info.update(task=self.task.id, turn=self.turn, edits=self.edits)
        self.close()
        return StepResult(obs, reward, True, info)

    def _files(self, under: Path | None = None) -> list[str]:
        root = self.root
        out = []
        for dirpath, dirnames, filenames in os.walk(under or root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_NAMES)
            out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f not in SKIP_NAMES]
        return sorted(out)


def _str_arg(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str):
        raise PatchError(f"the argument {key!r} must be a string")
    return value


def _restore(root: Path, rel: str, original: bytes | None) -> None:
    """Put the snapshot's file `rel` back (or remove it where the snapshot has none)."""
    path = resolve(root, rel)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if original is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(original)


def _link_or_copy(src: str, dst: str) -> str:
    # a hard link costs nothing, and edits replace files rather than write into them, so
    # the snapshot is never changed; another filesystem gets a copy
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
