"""The `swe` env's tasks: a generated set of small repositories with a planted bug, or
SWE-Gym-format instances from a folder the operator provides.

A task is SWE-bench's instance (Jimenez et al. 2024, arXiv 2310.06770; SWE-Gym, Pan
et al. 2024, arXiv 2412.21139, uses the same fields): a repository snapshot, the issue
(`problem_statement`), the reference fix (`patch`), the patch that adds the hidden
tests (`test_patch`), and the test ids graded: `FAIL_TO_PASS` (fail before the fix,
pass after) and `PASS_TO_PASS` (pass both before and after).

Generated (`generate_tasks`, deterministic for a seed): GENERATED_COUNT repositories,
each a package named from swe_templates.PACKAGES with two modules of swe_templates
(data/swe/*.toml; one with a planted bug, one correct), a README and visible unittest tests; the hidden tests
are the buggy module's visible tests (PASS_TO_PASS) and `tests/test_issue.py`
(FAIL_TO_PASS), which the test_patch adds. The pairs of module and bug are drawn without repeats until every
pair is used.

SWE-Gym format (`load_swe_gym`): `<data_dir>/*.jsonl` (or `*.json` holding a list, or
`*.parquet`, as the Hugging Face dataset ships), one instance a row, with
`instance_id`, `problem_statement`, `FAIL_TO_PASS` and `PASS_TO_PASS` (lists of test
ids, or JSON strings of lists as SWE-bench's files have them), `patch`, `test_patch`,
and optionally `repo`, `base_commit`; and `<data_dir>/repos/<instance_id>/`, the
repository at `base_commit` (the operator checks it out; `.git` is not needed). An
instance without its folder is skipped (logged).
"""

from __future__ import annotations

import ast
import difflib
import functools
import json
import logging
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.services.envhost.envs.swe_templates import PACKAGES, Bug, Module, modules

log = logging.getLogger("opentinker.envhost.swe")

GENERATED_SEED = 0
GENERATED_COUNT = 40
ISSUE_TEST = "tests/test_issue.py"
INSTANCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")


@dataclass(frozen=True)
class Task:
    """One instance (module docstring). The snapshot is `files` (path -> text: a
    generated task) or the folder `snapshot_dir`; `runner` is how its tests run
    (swe_runner: "unittest" or "pytest")."""

    id: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    repo: str = ""
    runner: str = "pytest"
    files: Mapping[str, str] | None = field(default=None, compare=False)
    snapshot_dir: str | None = None

    @property
    def hidden_tests(self) -> tuple[str, ...]:
        """The graded test ids, FAIL_TO_PASS then PASS_TO_PASS, without repeats."""
        return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))

    def original(self, rel: str) -> bytes | None:
        """The snapshot's file `rel` (a path the repository holds), None if it has none."""
        if self.files is not None:
            text = self.files.get(rel)
            return None if text is None else text.encode("utf-8")
        root = Path(os.path.realpath(self.snapshot_dir or ""))
        path = Path(os.path.realpath(root / rel))
        if root not in path.parents or not path.is_file():
            return None
        return path.read_bytes()


def unified_diff(old: Mapping[str, str], new: Mapping[str, str]) -> str:
    """A git-style unified diff from the files `old` to `new` (path -> text), paths
    sorted; /dev/null for a file only one side has."""
    out = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        out += difflib.unified_diff((a or "").splitlines(keepends=True), (b or "").splitlines(keepends=True),
                                    "/dev/null" if a is None else f"a/{path}",
                                    "/dev/null" if b is None else f"b/{path}")
    return "".join(out)


def unittest_ids(path: str, source: str) -> list[str]:
    """The ids (`path::Class::test_method`) of the unittest methods in `source`."""
    return [f"{path}::{node.name}::{fn.name}" for node in ast.parse(source).body if isinstance(node, ast.ClassDef)
            for fn in node.body if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")]


def _fill(text: str, pkg: str) -> str:
    return text.replace("PKG", pkg)


def make_task(index: int, pkg: str, module: Module, bug: Bug, companion: Module) -> Task:
    """The generated task of `bug` in `module`, in package `pkg` beside the correct `companion`."""
    fixed = _fill(module.source, pkg)
    if fixed.count(bug.fixed) != 1:
        raise AssertionError(f"{module.name}/{bug.key}: the fixed snippet must occur exactly once")
    buggy = fixed.replace(bug.fixed, bug.buggy, 1)
    mod_path, comp_path = f"{pkg}/{module.name}.py", f"{pkg}/{companion.name}.py"
    tests = {f"tests/test_{m.name}.py": _fill(m.tests, pkg) for m in (module, companion)}
    files = {
        "README.md": f"# {pkg}\n\nSmall Python helpers: {module.topic} (`{pkg}.{module.name}`) and "
                     f"{companion.topic} (`{pkg}.{companion.name}`).\n\nRun the tests with "
                     "`python -m unittest discover`.\n",
        f"{pkg}/__init__.py": f'"""{pkg}: {module.topic} and {companion.topic}."""\n',
        mod_path: buggy,
        comp_path: _fill(companion.source, pkg),
        "tests/__init__.py": "",
        **tests,
    }
    hidden = (f"import unittest\n\nfrom {pkg}.{module.name} import {', '.join(bug.names)}\n\n\n"
              f"class TestIssue(unittest.TestCase):\n{bug.hidden}")
    return Task(
        id=f"gen-{index:02d}-{bug.key}", repo=f"generated/{pkg}", runner="unittest",
        problem_statement=f"{bug.title}\n\n{_fill(bug.body, pkg)}\n",
        patch=unified_diff({mod_path: buggy}, {mod_path: fixed}),
        test_patch=unified_diff({}, {ISSUE_TEST: hidden}),
        fail_to_pass=tuple(unittest_ids(ISSUE_TEST, hidden)),
        pass_to_pass=tuple(unittest_ids(f"tests/test_{module.name}.py", tests[f"tests/test_{module.name}.py"])),
        files=files)


@functools.cache
def generate_tasks(seed: int = GENERATED_SEED, count: int = GENERATED_COUNT) -> tuple[Task, ...]:
    """`count` generated tasks (module docstring), the same for the same `seed`."""
    rng = random.Random(f"swe-generated:{seed}")
    templates = modules()
    pairs = [(m, b) for m in templates for b in m.bugs]
    names = list(PACKAGES)
    rng.shuffle(names)
    order: list[tuple[Module, Bug]] = []
    while len(order) < count:
        batch = list(pairs)
        rng.shuffle(batch)
        order += batch
    tasks = []
    for i, (module, bug) in enumerate(order[:count]):
        companion = rng.choice([m for m in templates if m is not module])
        tasks.append(make_task(i, names[i % len(names)], module, bug, companion))
    return tuple(tasks)


# --- SWE-Gym format -----------------------------------------------------------------

def _test_list(row: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = row.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise ValueError(f"{where}: {key} is neither a list nor a JSON list of test ids") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"{where}: {key} must be a list of test ids")
    return tuple(value)


def _text(row: dict[str, Any], key: str, where: str, required: bool = False) -> str:
    value = row.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise ValueError(f"{where}: {key} is required, a string" if required else f"{where}: {key} must be a string")
    return value


def _rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) of each instance in one data file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(f"{path}: row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist(), 1)]
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json data file holds a list of instances")
        return [(f"{path}: item {i}", r) for i, r in enumerate(data, 1)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return out


def instance(row: Any, where: str, repos: Path) -> Task:
    """The Task of one SWE-Gym row (module docstring), its snapshot `repos/<instance_id>`.
    Raises ValueError naming `where` and the field for a bad row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: an instance is a JSON object")
    iid = _text(row, "instance_id", where, required=True)
    if not INSTANCE_ID_RE.match(iid) or ".." in iid:
        raise ValueError(f"{where}: instance_id {iid[:100]!r} is not a plain name ([A-Za-z0-9_.-], no '..')")
    f2p = _test_list(row, "FAIL_TO_PASS", where)
    if not f2p:
        raise ValueError(f"{where}: FAIL_TO_PASS is empty: nothing would show the issue fixed")
    return Task(id=iid, problem_statement=_text(row, "problem_statement", where, required=True),
                patch=_text(row, "patch", where), test_patch=_text(row, "test_patch", where),
                fail_to_pass=f2p, pass_to_pass=_test_list(row, "PASS_TO_PASS", where),
                repo=_text(row, "repo", where), runner="pytest", snapshot_dir=str(repos / iid))


@functools.lru_cache(maxsize=8)
def _load(data_dir: str, stamp: tuple[tuple[str, int], ...]) -> tuple[Task, ...]:
    root = Path(data_dir)
    tasks: dict[str, Task] = {}
    missing = 0
    for name, _ in stamp:
        for where, row in _rows(root / name):
            task = instance(row, where, root / "repos")
            if task.id in tasks:
                raise ValueError(f"env_args.data_dir: {where}: instance_id {task.id!r} appears twice")
            if not Path(task.snapshot_dir).is_dir():
                missing += 1
                continue
            tasks[task.id] = task
    if missing:
        log.warning("swe: %d instances in %s have no repos/<instance_id>/ snapshot and are skipped", missing, data_dir)
    if not tasks:
        raise ValueError(f"env_args.data_dir: {data_dir} holds no instance with its snapshot in repos/<instance_id>/")
    return tuple(tasks[k] for k in sorted(tasks))


def load_swe_gym(data_dir: str | Path) -> tuple[Task, ...]:
    """The instances of a SWE-Gym-format folder (module docstring), sorted by id; read
    again when a data file changes. Raises ValueError naming the file and row of a bad
    instance, or the folder when it holds no data file or no instance with a snapshot."""
    root = Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"env_args.data_dir: {data_dir} is not a folder")
    files = sorted(p for p in root.iterdir() if p.suffix in (".jsonl", ".json", ".parquet") and p.is_file())
    if not files:
        raise ValueError(f"env_args.data_dir: {data_dir} holds no *.jsonl, *.json or *.parquet file of instances")
    return _load(str(root.resolve()), tuple((p.name, p.stat().st_mtime_ns) for p in files))
