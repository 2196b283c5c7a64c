"""Reading an answer out of a model's reply, shared by the built-in verifiers.

`first_number` / `final_number` are plain regex readers (arith, guess-number).
`verify_answer` is the math verifier (gsm8k): HuggingFace's Math-Verify
(github.com/huggingface/Math-Verify) compares the reply to the gold answer as
mathematics ("72.00", "$1,200", "\\boxed{\\frac{1}{2}}" vs "0.5").

Math-Verify bounds its work with `signal.alarm`, which works only in a process's main
thread, and the envhost calls `step` from worker threads; without that alarm a reply
such as "$10^{10^{10}}$" keeps sympy busy for hours. So the check runs in a small
pool of child processes (this module run as `python -m`), each using Math-Verify's
own timeouts in its main thread, and a child that overruns the parent's deadline is
killed and replaced: a pathological reply costs one episode its reward, never a thread.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import queue
import re
import select
import subprocess
import sys

# An optional sign, then either comma-grouped thousands ("1,234") or plain digits,
# then an optional decimal part. A leading "$" is skipped by the search itself.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_MARK = "####"

#: Math-Verify's own limits inside a child (whole seconds: they feed signal.alarm).
PARSE_TIMEOUT_S = 3
VERIFY_TIMEOUT_S = 3
#: The parent's deadline for one check; past it the child is killed. Covers two
#: parses and a comparison, plus the child's start (importing sympy takes seconds).
CHECK_DEADLINE_S = 30.0
#: Only the reply's tail is searched: answers come last, and Math-Verify's regexes
#: take about 0.5 s on 10,000 characters of numbers.
MAX_REPLY_CHARS = 4000
#: Child processes (about 150 MB each); a check takes about a millisecond.
POOL_SIZE = 2


def _value(token: str) -> float:
    return float(token.replace(",", ""))


def first_number(text: str) -> float | None:
    """The first number in `text` (after stripping), or None when there is none.

    "42", " 42.", "The answer is 42" and "$1,200" read as 42, 42, 42 and 1200;
    "3 + 4 = 7" reads as 3: a verifier that takes the first number does not reward a
    reply that merely mentions the answer after restating the question.
    """
    m = _NUMBER.search(text.strip())
    return _value(m.group()) if m else None


def final_number(text: str) -> float | None:
    """The answer a reply ends on: the first number after the last "####" if the reply
    uses GSM8K's answer mark, otherwise the last number in the reply; None if none."""
    if _MARK in text:
        return first_number(text.rsplit(_MARK, 1)[1])
    found = _NUMBER.findall(text)
    return _value(found[-1]) if found else None


def same_number(got: float | None, want: float) -> bool:
    """Numeric equality with a tolerance for float noise ("72.0" == 72)."""
    return got is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))


def answer_text(reply: str) -> str:
    """The part of `reply` that holds its final answer: the first non-empty line after
    the last "####" mark when there is one (so "#### 18\\nHope this helps!" is "18"),
    else the reply's last MAX_REPLY_CHARS characters."""
    if _MARK in reply:
        tail = reply.rsplit(_MARK, 1)[1].strip()
        return tail.split("\n", 1)[0].strip()
    return reply[-MAX_REPLY_CHARS:]


def verify_answer(reply: str, gold: str) -> tuple[bool, str]:
    """(correct?, what was read) for a model's `reply` against the `gold` answer.

    The answer is read from `answer_text(reply)` by Math-Verify: a \\boxed{} answer
    first, else the last LaTeX or plain expression; "1,200", "$18." and "3 + 4 = 7"
    read as 1200, 18 and 7, and \\frac{1}{2} equals 0.5 (to 6 decimal places). The
    second value is the extracted answer as written ("" when none was found), or
    "<timeout>" when the check overran CHECK_DEADLINE_S and its child was killed.
    Safe to call from any thread.

    Raises ImportError when math-verify is not installed (the `server` extra has it),
    RuntimeError when a checker process dies without answering.
    """
    text = answer_text(reply)
    if not text.strip():
        return False, ""
    checker = _idle.get()
    try:
        return checker.check(text, gold)
    finally:
        _idle.put(checker)


def _check(text: str, gold: str, parse, verify) -> tuple[bool, str]:
    """One comparison, run inside a checker process (its main thread)."""
    want = parse(gold, parsing_timeout=PARSE_TIMEOUT_S)
    got = parse(text, parsing_timeout=PARSE_TIMEOUT_S)
    if not got:
        return False, ""
    # parse returns [sympy value, the matched string] or [string] when sympy failed.
    read = got[-1] if isinstance(got[-1], str) else str(got[0])
    return bool(verify(want, got, timeout_seconds=VERIFY_TIMEOUT_S)), read


class _Checker:
    """One child process answering JSON lines [text, gold] with [correct, read]."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("verify_answer needs math-verify: pip install 'opentinker[server]'")
        return subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)

    def check(self, text: str, gold: str) -> tuple[bool, str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps([text, gold]) + "\n")
        proc.stdin.flush()
        # One request, one reply line: the pipe's buffer is empty here, so select sees
        # exactly the bytes of this reply.
        ready, _, _ = select.select([proc.stdout], [], [], CHECK_DEADLINE_S)
        if not ready:
            self.close(kill=True)
            return False, "<timeout>"
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            self.proc = None
            raise RuntimeError(f"math-verify checker exited with code {code} without answering")
        ok, read = json.loads(line)
        return bool(ok), str(read)

    def close(self, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            assert proc.stdin is not None
            proc.stdin.close()  # the child's loop ends at end of input
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None and not f.closed:
                f.close()


_checkers = [_Checker() for _ in range(POOL_SIZE)]
# LIFO, so a warm child is reused before a second one is started.
_idle: queue.LifoQueue[_Checker] = queue.LifoQueue()
for _c in _checkers:
    _idle.put(_c)


@atexit.register
def _close_checkers() -> None:
    for c in _checkers:
        c.close()


def _serve() -> None:
    """The checker process's loop: read [text, gold] lines, write [correct, read]."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    out, sys.stdout = sys.stdout, sys.stderr  # stray prints must not corrupt replies
    for line in sys.stdin:
        text, gold = json.loads(line)
        try:
            ok, read = _check(text, gold, parse, verify)
        except Exception as e:  # noqa: BLE001 — math-verify raises what sympy raises
            print(f"math-verify check failed: {e!r}", file=sys.stderr)
            ok, read = False, ""
        out.write(json.dumps([ok, read]) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
