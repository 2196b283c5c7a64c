"""The `swe` env: a scripted agent's correct fix earns 1.0, a wrong one less, a change
that does not apply -0.2; the repository's code runs only in the sandbox, which ends a
runaway test, a fork bomb, a memory hog and a flood of output; hostile paths are
refused; the generated tasks are deterministic and each one's reference fix passes
every hidden test while the unfixed repository fails exactly the FAIL_TO_PASS ones;
SWE-Gym-format folders load."""

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from opentinker.environment.base_game import opening
from opentinker.services.envhost.envs.swe import PATCH_FAILED_REWARD, SWEGame, parse_command
from opentinker.services.envhost.envs.swe_patch import PatchError, apply_patch
from opentinker.services.envhost.envs.swe_runner import Suite, run_suites
from opentinker.services.envhost.envs.swe_tasks import GENERATED_COUNT, generate_tasks, load_swe_gym
from opentinker.services.envhost.sandbox import SandboxLimits

TASKS = generate_tasks()


def task_of(key: str):
    return next(t for t in TASKS if t.id.endswith(key))


def fix_as_edit(task) -> str:
    """A scripted agent's `edit` command, written from the reference diff's -/+ lines."""
    lines = task.patch.splitlines()
    path = next(ln[6:] for ln in lines if ln.startswith("+++ b/"))
    old = [ln[1:] for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    new = [ln[1:] for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
    return f"edit {path}\n<<<<<<< SEARCH\n" + "\n".join(old) + "\n=======\n" + "\n".join(new) + \
        "\n>>>>>>> REPLACE"


def module_path(task) -> str:
    return next(ln[6:] for ln in task.patch.splitlines() if ln.startswith("+++ b/"))


def start(task, **env_args) -> SWEGame:
    game = SWEGame(**{"timeout_s": 10, **env_args})
    system, user = opening(game, {"task": task.id})
    assert "submit" in system and task.problem_statement.strip() in user
    return game


def test_a_scripted_agent_that_reads_the_code_and_fixes_it_earns_1():
    task = task_of("chunk-drops-last")
    game = start(task)
    root = game.root
    assert module_path(task) in game.get_initial_user_message()
    assert "tests/test_issue.py" not in game.get_initial_user_message()  # hidden tests stay hidden

    r = game.step(f"Let me look.\nread_file {module_path(task)}")
    assert (r.reward, r.done) == (0.0, False) and "len(items) - size + 1" in r.observation
    r = game.step(fix_as_edit(task))
    assert (r.observation, r.reward, r.done) == (f"Edited {module_path(task)}.", 0.0, False)
    r = game.step("run_tests")
    assert "Ran " in r.observation and r.observation.rstrip().endswith("OK") and not r.done
    r = game.step("submit")
    assert (r.reward, r.done) == (1.0, True), r.observation
    assert r.info["resolved"] and r.info["passed"] == r.info["total"] == len(task.hidden_tests)
    assert "Hidden tests: 7 of 7 passed." in r.observation
    assert not root.exists()  # the episode's copy is gone

    # the reference diff, sent as a tool call, earns the same; so does a bare diff
    for action in (f'<tool_call>{json.dumps({"name": "apply_patch", "arguments": {"patch": task.patch}})}'
                   "</tool_call>", f"```diff\n{task.patch}```"):
        game = start(task, max_turns=1)  # the one reply is graded
        r = game.step(action)
        assert (r.reward, r.done, r.info["ended"]) == (1.0, True, "max_turns"), r.observation


def test_a_wrong_fix_earns_less_and_the_hidden_tests_cannot_be_edited_away():
    task = task_of("leap-year-400")
    game = start(task)
    # "fixes" the wrong line, and writes its own passing tests over the hidden and visible ones
    r = game.step(f"edit {module_path(task)}\n<<<<<<< SEARCH\n    return year % 4 == 0 and year % 100 != 0\n"
                  "=======\n    return year % 4 == 0\n>>>>>>> REPLACE")
    assert not r.done, r.observation
    fake = "import unittest\n\n\nclass TestIssue(unittest.TestCase):\n    def test_year_2000(self):\n        pass\n"
    r = game.step(f"edit tests/test_issue.py\n<<<<<<< SEARCH\n=======\n{fake}>>>>>>> REPLACE")
    assert r.observation == "Created tests/test_issue.py." and not r.done
    r = game.step("submit")
    # 1900 is now a leap year: the visible test_leap_years fails, the two issue tests pass
    assert r.done and 0 <= r.reward < 1
    assert r.reward == pytest.approx((len(task.hidden_tests) - 1) / len(task.hidden_tests))
    assert r.info["failed_tests"] == ["tests/test_numbers.py::TestNumbers::test_leap_years"]

    # no change at all: only the PASS_TO_PASS tests pass
    game = start(task)
    r = game.step("submit")
    assert r.reward == pytest.approx(len(task.pass_to_pass) / len(task.hidden_tests)) and not r.info["resolved"]


def test_the_resolved_reward_is_1_only_when_every_hidden_test_passes():
    """env_args.reward = "resolved" (SWE-bench's resolved rate): the reference fix earns 1,
    an unchanged repository 0 where "fraction" gives it its PASS_TO_PASS share."""
    task = task_of("leap-year-400")
    r = start(task, reward="resolved").step("submit")
    assert (r.reward, r.done, r.info["resolved"]) == (0.0, True, False) and r.info["passed"] > 0, r.info
    game = start(task, reward="resolved")
    assert not game.step(fix_as_edit(task)).done
    assert game.step("submit").reward == 1.0
    with pytest.raises(ValueError, match="env_args.reward: must be one of"):
        SWEGame(reward="partial")


@pytest.mark.parametrize("action, why", [
    ("edit {mod}\n<<<<<<< SEARCH\n    return nothing_like_this\n=======\n    pass\n>>>>>>> REPLACE",
     "the SEARCH text is not in the file"),
    ("edit {mod}\n<<<<<<< SEARCH\nraise ValueError(\n=======\nreturn (\n>>>>>>> REPLACE", "occurs 2 times"),
    ("edit {mod}\n<<<<<<< SEARCH\n    return x\n=======\n    return y\n", "not closed"),
    ("edit {mod}\nI would change the return line.", "no SEARCH/REPLACE block"),
    ("edit README.md\n<<<<<<< SEARCH\n=======\nnew\n>>>>>>> REPLACE", "exists"),
    ("apply_patch\n--- a/{mod}\n+++ b/{mod}\n@@ -1,3 +1,3 @@\n-nothing\n+something\n", "hunk ends early"),
    ("apply_patch\n--- a/{mod}\n+++ b/{mod}\n@@ -1,1 +1,1 @@\n-no such line\n+x\n", "does not match"),
    ("apply_patch\nplease apply my fix", "no unified diff found"),
    ("apply_patch\n--- a/missing.py\n+++ b/missing.py\n@@ -1 +1 @@\n-a\n+b\n", "no such file"),
    ('<tool_call>{"name": "edit", "arguments": {"path": "{mod}"}}</tool_call>', "'search' must be a string"),
    # hostile paths in an edit or a patch end the episode too
    ("edit ../outside.py\n<<<<<<< SEARCH\n=======\nx = 1\n>>>>>>> REPLACE", "'..' is refused"),
    ("edit /etc/passwd\n<<<<<<< SEARCH\nroot\n=======\nx\n>>>>>>> REPLACE", "absolute paths are refused"),
    ("apply_patch\n--- /dev/null\n+++ b/../../evil.py\n@@ -0,0 +1 @@\n+x = 1\n", "'..' is refused"),
    ("apply_patch\n--- /dev/null\n+++ b/.git/hooks/pre-commit\n@@ -0,0 +1 @@\n+x\n", ".git"),
])
def test_a_change_that_does_not_apply_ends_the_episode_with_minus_0_2(action, why):
    task = task_of("median-even")
    game = start(task)
    root = game.root
    r = game.step(action.replace("{mod}", module_path(task)))
    assert (r.reward, r.done, r.info["ended"]) == (PATCH_FAILED_REWARD, True, "patch_failed"), r.observation
    assert why in r.observation and why in r.info["error"]
    assert not root.exists()
    assert not (root.parent / "outside.py").exists() and not (root.parent.parent / "evil.py").exists()


def test_reads_and_test_runs_outside_the_repository_are_refused_without_ending_the_episode(tmp_path):
    task = task_of("median-even")
    game = start(task, max_turns=20)
    for action, why in (("read_file ../../../../etc/passwd", "'..' is refused"),
                        ("read_file /etc/passwd", "absolute paths are refused"),
                        ("read_file .git/config", ".git"),
                        ("read_file nothing.py", "no such file"),
                        ("run_tests /etc/passwd", "absolute paths are refused"),
                        ("run_tests tests/test_nothing.py", "no such file"),
                        ("Hello! I will fix it.", "no command found"),
                        ('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>', "unknown tool")):
        r = game.step(action)
        assert (r.reward, r.done) == (0.0, False) and why in r.observation, (action, r.observation)
    r = game.step(f"read_file {module_path(task)} 4-6")
    assert r.observation.startswith(f"{module_path(task)} (lines 4-6 of ") and "def clamp" in r.observation
    r = game.step("read_file tests")
    assert "tests/test_numbers.py" in r.observation


def test_a_symlink_in_a_snapshot_cannot_reach_the_host(tmp_path):
    data = swe_gym_folder(tmp_path)
    outside = tmp_path / "secret.txt"
    outside.write_text("host secret\n")
    os.symlink(outside, data / "repos" / "calc__calc-1" / "leak.txt")
    os.symlink("/etc", data / "repos" / "calc__calc-1" / "etc")
    game = SWEGame(data_dir=str(data), max_turns=5)
    opening(game, {"task": "calc__calc-1"})
    for path in ("leak.txt", "etc/passwd"):
        r = game.step(f"read_file {path}")
        assert "leads outside the repository" in r.observation and "host secret" not in r.observation
    r = game.step("edit leak.txt\n<<<<<<< SEARCH\nhost secret\n=======\nchanged\n>>>>>>> REPLACE")
    assert r.reward == PATCH_FAILED_REWARD and "leads outside the repository" in r.observation
    assert outside.read_text() == "host secret\n"


def test_the_sandbox_ends_runaway_forking_hungry_and_noisy_code_with_an_observation():
    task = task_of("binary-search-ends")
    mod = module_path(task)
    game = start(task, timeout_s=3, max_turns=10, max_output_chars=2000)
    # a flood of output is cut, keeping its start and end
    r = game.step(f"edit {mod}\n<<<<<<< SEARCH\n\"\"\"Searching sequences.\"\"\"\n=======\n"
                  "print('x' * 5_000_000)\n>>>>>>> REPLACE")
    r = game.step("run_tests")
    assert "output truncated" in r.observation and len(r.observation) < 3000 and not r.done
    # a memory hog gets a MemoryError
    r = game.step(f"edit {mod}\n<<<<<<< SEARCH\nprint('x' * 5_000_000)\n=======\n"
                  "x = bytearray(8 * 1024 ** 3)\n>>>>>>> REPLACE")
    r = game.step("run_tests")
    assert "MemoryError" in r.observation and not r.done
    # a fork bomb is held to the process limit and the wall clock
    r = game.step(f"edit {mod}\n<<<<<<< SEARCH\nx = bytearray(8 * 1024 ** 3)\n=======\n"
                  "import os\nwhile True:\n    os.fork()\n>>>>>>> REPLACE")
    t0 = time.monotonic()
    r = game.step("run_tests")
    assert time.monotonic() - t0 < 3 + 2 and not r.done
    assert "timed out after 3 s" in r.observation or "process limit" in r.observation or \
        "BlockingIOError" in r.observation, r.observation[-500:]
    # a test that never ends: killed at the wall clock; finished tests still count
    r = game.step(f"edit {mod}\n<<<<<<< SEARCH\nimport os\nwhile True:\n    os.fork()\n=======\n\n>>>>>>> REPLACE")
    r = game.step(f"edit {mod}\n<<<<<<< SEARCH\n            lo = mid + 1\n=======\n            lo = mid\n"
                  ">>>>>>> REPLACE")
    assert r.observation == f"Edited {mod}." and not r.done
    t0 = time.monotonic()
    r = game.step("submit")
    assert time.monotonic() - t0 < 3 + 2
    assert r.done and 0 <= r.reward < 1 and r.info["timed_out"] and not r.info["finished"]
    assert "[timed out after 3 s: the process was killed] Tests that had not finished count as failed." \
        in r.observation


def check_tasks(tasks) -> list[str]:
    """Every task's problems: its reference fix must pass every hidden test and the
    unfixed repository must fail exactly FAIL_TO_PASS (both runs to their end). All in one
    sandbox run, with the env's own runner."""
    suites = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in tasks:
            for fixed in (False, True):
                root = Path(tmp, f"{t.id}-{fixed}").resolve()
                for rel, text in t.files.items():
                    (root / rel).parent.mkdir(parents=True, exist_ok=True)
                    (root / rel).write_text(text)
                if fixed and t.patch:
                    apply_patch(root, t.patch)
                apply_patch(root, t.test_patch)
                suites.append(Suite(root, tuple(sorted({i.split("::")[0] for i in t.hidden_tests})), True))
        run = run_suites(suites, "unittest", SandboxLimits(timeout_s=60, cpu_s=61, max_output_chars=1 << 20))
    problems = []
    for t, unfixed, fixed in zip(tasks, run.suites[::2], run.suites[1::2]):
        failing = {i for i in t.hidden_tests if not unfixed.passed.get(i)}
        if failing != set(t.fail_to_pass) or not unfixed.finished:
            problems.append(f"{t.id}: unfixed, failing {sorted(failing)}")
        if not all(fixed.passed.get(i) for i in t.hidden_tests) or not fixed.finished:
            problems.append(f"{t.id}: fixed, not all hidden tests pass")
    return problems


def test_the_generated_tasks_are_deterministic_and_each_reference_fix_passes_every_hidden_test():
    again = generate_tasks.__wrapped__()  # built afresh, not the cached tuple
    assert len(TASKS) == GENERATED_COUNT == 40 and len({t.id for t in TASKS}) == 40
    assert [(t.id, t.patch, t.test_patch, dict(t.files)) for t in again] == \
        [(t.id, t.patch, t.test_patch, dict(t.files)) for t in TASKS]
    assert [t.id for t in generate_tasks.__wrapped__(seed=1)] != [t.id for t in TASKS]
    assert len({t.id.split("-", 2)[2] for t in TASKS}) == 32  # every planted bug is used
    assert all(t.fail_to_pass and t.pass_to_pass for t in TASKS)
    # the check below can fail: a task whose "fix" is missing is caught
    broken = dataclasses.replace(TASKS[0], id="broken", patch="")
    problems = check_tasks([*TASKS, broken])
    assert problems == ["broken: fixed, not all hidden tests pass"]


def test_an_episode_offers_tools_the_teacher_reads_the_reference_fix_and_splits_hold_out_tasks():
    game = SWEGame()
    assert [t["function"]["name"] for t in game.get_tools()] == ["read_file", "edit", "apply_patch", "run_tests",
                                                                 "submit"]
    game.reset(task=TASKS[3].id)
    assert TASKS[3].patch in game.get_privileged_context()
    game.close()
    train = {game.generate_initial_state(s, "train")["task"] for s in range(400)}
    test = {game.generate_initial_state(s, "test")["task"] for s in range(400)}
    assert len(test) == 8 and len(train) == 32 and not train & test
    with pytest.raises(ValueError, match="env_args.bogus"):
        SWEGame(bogus=1)
    with pytest.raises(ValueError, match="env_args.runner"):
        SWEGame(runner="nose")


def test_commands_are_read_from_plain_text_and_tool_calls():
    assert parse_command("I'll look first.\n`read_file pkg/a.py 3-9`") == (
        "read_file", {"path": "pkg/a.py", "start_line": 3, "end_line": 9}, "")
    assert parse_command("run_tests tests/test_a.py")[:2] == ("run_tests", {"path": "tests/test_a.py"})
    assert parse_command("submit") == ("submit", {}, "")
    assert parse_command("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n")[0] == "apply_patch"
    call = '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"a.py\\"}"}</tool_call>'
    assert parse_command(call) == ("read_file", {"path": "a.py"}, "")
    assert parse_command("<tool_call>{not json</tool_call>")[2].startswith("the tool call is not valid JSON")


def swe_gym_folder(tmp_path: Path) -> Path:
    """A SWE-Gym-format folder: instances.jsonl (one with its test lists as JSON strings,
    as SWE-bench's files hold them; one with no snapshot) and repos/<instance_id>/."""
    data = tmp_path / "swe-gym"
    repo = data / "repos" / "calc__calc-1"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text("def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n")
    (repo / "tests" / "test_ops.py").write_text(
        "from calc.ops import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n")
    patch = ("diff --git a/calc/ops.py b/calc/ops.py\n--- a/calc/ops.py\n+++ b/calc/ops.py\n"
             "@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n")
    test_patch = ("--- a/tests/test_ops.py\n+++ b/tests/test_ops.py\n@@ -1,5 +1,9 @@\n-from calc.ops import neg\n"
                  "+from calc.ops import add, neg\n \n \n def test_neg():\n     assert neg(2) == -2\n+\n+\n"
                  "+def test_add():\n+    assert add(2, 3) == 5\n")
    rows = [{"instance_id": "calc__calc-1", "repo": "calc/calc", "base_commit": "abc123",
             "problem_statement": "add(2, 3) returns -1", "patch": patch, "test_patch": test_patch,
             "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::test_add"]),
             "PASS_TO_PASS": json.dumps(["tests/test_ops.py::test_neg"]), "version": "1.0"},
            {"instance_id": "calc__calc-2", "problem_statement": "no snapshot", "patch": "", "test_patch": "",
             "FAIL_TO_PASS": ["tests/test_ops.py::test_x"], "PASS_TO_PASS": []}]
    (data / "instances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_a_swe_gym_folder_loads_and_its_reference_patch_earns_1_under_pytest(tmp_path):
    data = swe_gym_folder(tmp_path)
    tasks = load_swe_gym(data)
    assert [t.id for t in tasks] == ["calc__calc-1"]  # calc__calc-2 has no repos/ folder
    assert tasks[0].fail_to_pass == ("tests/test_ops.py::test_add",) and tasks[0].runner == "pytest"
    game = SWEGame(data_dir=str(data), max_turns=3, timeout_s=60)
    assert game.generate_initial_state(5, "test") == {"task": "calc__calc-1"}  # too few to hold out
    _, user = opening(game, {"task": "calc__calc-1"})
    assert "add(2, 3) returns -1" in user and "calc/ops.py" in user
    assert tasks[0].patch in game.get_privileged_context()
    r = game.step(f"apply_patch\n{tasks[0].patch}")
    assert r.observation == "Patched calc/ops.py." and not r.done
    r = game.step("submit")
    assert (r.reward, r.info["passed"], r.info["total"]) == (1.0, 2, 2), r.observation
    assert (data / "repos" / "calc__calc-1" / "calc" / "ops.py").read_text().count("a - b") == 1  # untouched

    # a bad row is refused naming the file, the line and the field
    (data / "more.jsonl").write_text('{"instance_id": "x", "problem_statement": "p"}\n')
    with pytest.raises(ValueError, match=r"more.jsonl:1: FAIL_TO_PASS is empty"):
        load_swe_gym(data)
    (data / "more.jsonl").write_text('{"instance_id": "../x", "problem_statement": "p"}\n')
    with pytest.raises(ValueError, match=r"more.jsonl:1: instance_id '../x' is not a plain name"):
        load_swe_gym(data)


def test_a_patch_applies_at_an_offset_and_refuses_renames(tmp_path):
    root = tmp_path.resolve()
    (root / "a.py").write_text("".join(f"line {i}\n" for i in range(1, 21)))
    # the hunk says line 3; the lines are at 13
    apply_patch(root, "--- a/a.py\n+++ b/a.py\n@@ -3,3 +3,3 @@\n line 12\n-line 13\n+LINE 13\n line 14\n")
    assert "LINE 13\n" in (root / "a.py").read_text()
    with pytest.raises(PatchError, match="renames"):
        apply_patch(root, "diff --git a/a.py b/b.py\nrename from a.py\nrename to b.py\n")
    # a new file and a deletion in one patch, with a missing final newline
    apply_patch(root, "--- /dev/null\n+++ b/new/c.py\n@@ -0,0 +1 @@\n+x = 1\n\\ No newline at end of file\n")
    assert (root / "new" / "c.py").read_text() == "x = 1"
    apply_patch(root, "--- a/new/c.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x = 1\n\\ No newline at end of file\n")
    assert not (root / "new" / "c.py").exists()
