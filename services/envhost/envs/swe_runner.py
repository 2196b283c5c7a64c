"""A repository's tests, run in the sandbox (`sandbox.run_python`): the `swe` env's
`run_tests` tool and its grading.

One sandbox run takes one or more suites. Each suite's repository travels in a tar
archive placed beside the driver program (main.py) in the sandbox's /work tmpfs, is
unpacked there, and its tests run in the driver's process, one suite after another
(the modules a suite imported are forgotten before the next). The repository's code
therefore runs only inside the sandbox: no network, no host files, bounded wall clock,
CPU, memory, processes and output.

Runners:
- "unittest" (the standard library's; no dependency): targets are test files
  (`tests/test_x.py`) or test ids in pytest's form (`tests/test_x.py::TestCase::test_y`);
  no target discovers `test*.py` from the repository root (packages need an
  `__init__.py`, as unittest's discovery wants).
- "pytest": the envhost's installed pytest (and its dependencies) made importable in
  the sandbox, read-only; targets are pytest's own (files or node ids). The
  repository's own pytest configuration applies; `-p no:cacheprovider` keeps it from
  writing a cache.

A suite either shows the runner's own output (what the policy reads) or reports each
test's result (grading): one line per finished test, `<nonce> <suite> P|F <test id>`,
written to a copy of the run's stdout taken before any test runs, then `<nonce>
<suite> DONE -`. The nonce is fresh per run, so text a test prints cannot pass for a
result line; the tests' own output goes to /dev/null. A test that never reported
(the run timed out or the process died first, or it was not found) has not passed.
The code under test shares the driver's process, so code written to attack the driver
(read its nonce, patch its reporter) could forge results: the grading is as honest
as SWE-bench's (whose harness parses the test log), not more.
"""

from __future__ import annotations

import io
import json
import secrets
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path

from opentinker.services.envhost import sandbox

RUNNERS = ("unittest", "pytest")
#: distributions bound into the sandbox for the "pytest" runner (pytest 8/9 and its deps)
PYTEST_PACKAGES = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")
#: names and folders never copied into the sandbox
SKIP_NAMES = frozenset({".git", "__pycache__", ".pytest_cache"})

_DRIVER = r'''
import json, os, sys, tarfile, traceback
CFG = json.loads(%(cfg)r)
NONCE = CFG["nonce"]
OUT = os.fdopen(os.dup(1), "w", buffering=1)

def emit(i, status, test_id):
    OUT.write("%%s %%d %%s %%s\n" %% (NONCE, i, status, test_id))

with tarfile.open("/work/repos.tar") as t:
    t.extractall("/work", filter="tar")
BASE_MODULES = set(sys.modules)
BASE_PATH = list(sys.path)


def run_unittest(i, root, targets, grade):
    import unittest

    def test_id(test):
        mod = sys.modules.get(type(test).__module__)
        f = getattr(mod, "__file__", None) or ""
        method = getattr(test, "_testMethodName", None)
        if method and f.startswith(root + "/"):
            return "%%s::%%s::%%s" %% (os.path.relpath(f, root), type(test).__qualname__, method)
        return test.id()

    class Result(unittest.TextTestResult):
        def startTest(self, test):
            self.ok = True
            super().startTest(test)

        def _bad(self, *a):
            self.ok = False

        def addFailure(self, test, err):
            self._bad(); super().addFailure(test, err)

        def addError(self, test, err):
            self._bad(); super().addError(test, err)

        def addSkip(self, test, reason):
            self._bad(); super().addSkip(test, reason)

        def addUnexpectedSuccess(self, test):
            self._bad(); super().addUnexpectedSuccess(test)

        def addSubTest(self, test, subtest, err):
            if err is not None:
                self._bad()
            super().addSubTest(test, subtest, err)

        def stopTest(self, test):
            super().stopTest(test)
            if grade:
                emit(i, "P" if self.ok else "F", test_id(test))

    loader = unittest.TestLoader()
    if targets:
        suite = unittest.TestSuite()
        for t in targets:
            path, _, rest = t.partition("::")
            name = path[:-3].replace("/", ".") if path.endswith(".py") else path.replace("/", ".")
            if rest:
                name += "." + rest.replace("::", ".")
            try:
                suite.addTest(loader.loadTestsFromName(name))
            except Exception:  # the module under test does not import: its tests fail
                traceback.print_exc()
    else:
        suite = loader.discover(".", pattern="test*.py", top_level_dir=".")
    stream = open(os.devnull, "w") if grade else sys.stdout
    try:
        unittest.TextTestRunner(stream=stream, verbosity=1 if grade else 2, resultclass=Result,
                                buffer=True).run(suite)
    finally:
        if grade:
            stream.close()


def run_pytest(i, root, targets, grade):
    import pytest

    class Reporter:
        def __init__(self):
            self.bad = set()
            self.passed = set()

        def pytest_runtest_logreport(self, report):
            nid = report.nodeid
            if report.failed:
                self.bad.add(nid)
            if report.when == "call" and (report.passed or hasattr(report, "wasxfail")):
                self.passed.add(nid)
            if report.when == "teardown":
                emit(i, "P" if nid in self.passed and nid not in self.bad else "F", nid)

    args = ["-p", "no:cacheprovider", "--rootdir", root, "--continue-on-collection-errors"]
    args += ["-q", "--tb=no"] if grade else ["-q", "--tb=short"]
    pytest.main(args + list(targets), plugins=[Reporter()] if grade else [])


for i, s in enumerate(CFG["suites"]):
    root = "/work/s%%d" %% i
    for name, m in list(sys.modules.items()):  # the previous suite's repository, not the runner
        where = [getattr(m, "__file__", None) or ""] + list(getattr(m, "__path__", None) or ())
        if name not in BASE_MODULES and any(str(w).startswith("/work/") for w in where):
            del sys.modules[name]
    sys.path[:] = [root] + BASE_PATH
    os.chdir(root)
    saved = None
    if s["report"]:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1); os.dup2(null, 2); os.close(null)
    try:
        (run_pytest if CFG["runner"] == "pytest" else run_unittest)(i, root, s["targets"], s["report"])
    except (Exception, SystemExit):
        traceback.print_exc()
    finally:
        if saved:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
    emit(i, "DONE", "-")
'''


@dataclass(frozen=True)
class Suite:
    """One repository to test: `root` (a folder on the host, copied into the sandbox
    without `.git` and caches), `targets` (test files or ids; () = every test) and
    `report` (per-test results for grading, instead of the runner's own output)."""

    root: Path
    targets: tuple[str, ...] = ()
    report: bool = False


@dataclass(frozen=True)
class SuiteResult:
    """What one suite did. `passed`: test id -> whether it passed (report suites; a test
    reported twice passes only if it passed both times); `finished`: the suite ran to
    its end (False when the run timed out or its process died first)."""

    passed: dict[str, bool]
    finished: bool


@dataclass(frozen=True)
class SuitesRun:
    """A sandbox run of suites: `run` is the sandbox's RunResult with the result lines
    taken out of its output (`run.observation()` is what the policy reads)."""

    run: sandbox.RunResult
    suites: list[SuiteResult]

    def note(self) -> str:
        """The sandbox's line on how the run ended ("" for a normal exit): e.g.
        "[timed out after 10 s: the process was killed]"."""
        out = self.run.output if self.run.output.strip() else "(no output)"
        obs = self.run.observation()
        return "" if obs == out else obs[len(out.rstrip()):].strip()


def pack(suites: list[Suite]) -> bytes:
    """An uncompressed tar of the suites' folders, suite i as `s<i>/` (symlinks kept as
    links: inside the sandbox they reach nothing of the host)."""
    buf = io.BytesIO()

    def skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if set(Path(info.name).parts) & SKIP_NAMES:
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = (info.mode | 0o644) & 0o755 if info.isfile() else info.mode | 0o755
        return info

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i, s in enumerate(suites):
            tar.add(str(s.root), arcname=f"s{i}", filter=skip)
    return buf.getvalue()


def run_suites(suites: list[Suite], runner: str, limits: sandbox.SandboxLimits,
               packages: tuple[str, ...] = ()) -> SuitesRun:
    """Run `suites` in one sandbox run with `runner` ("unittest" or "pytest"; module
    docstring), `packages` (more distributions made importable) bound besides the runner's.

    Returns within about `limits.timeout_s`, whatever the tests do. Raises ValueError for
    an unknown runner, SandboxUnavailable where no sandbox can be made.
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner: {runner!r} is not one of {RUNNERS}")
    nonce = secrets.token_hex(16)
    cfg = {"nonce": nonce, "runner": runner,
           "suites": [{"targets": list(s.targets), "report": s.report} for s in suites]}
    binds = tuple(dict.fromkeys((*(PYTEST_PACKAGES if runner == "pytest" else ()), *packages)))
    run = sandbox.run_python(_DRIVER % {"cfg": json.dumps(cfg)}, limits, packages=binds,
                             files={"repos.tar": pack(suites)})
    passed: list[dict[str, bool]] = [{} for _ in suites]
    done = [False] * len(suites)
    kept = []
    for line in run.output.splitlines(keepends=True):
        if not line.startswith(nonce + " "):
            kept.append(line)
            continue
        parts = line.rstrip("\n").split(" ", 3)
        if len(parts) != 4 or not parts[1].isdigit() or int(parts[1]) >= len(suites):
            continue
        i, status, test = int(parts[1]), parts[2], parts[3]
        if status == "DONE":
            done[i] = True
        elif status in ("P", "F"):
            passed[i][test] = passed[i].get(test, True) and status == "P"
    return SuitesRun(replace(run, output="".join(kept)),
                   [SuiteResult(p, d) for p, d in zip(passed, done)])
