"""`opentinker sandbox` (services/envhost/sandbox_server.py): SandboxFusion's /run_code
served with the bubblewrap sandbox, and upstream's CodeInterpreterMathGame
(environment/math/math_tool_game.py) playing against it."""

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from opentinker.environment.math import CodeInterpreterMathGame
from opentinker.environment.math.math_tool_env import MathCodeInterpreterEnvironment
from opentinker.services.core.http import serve_http
from opentinker.services.envhost.sandbox import SandboxLimits
from opentinker.services.envhost.sandbox_server import check_loopback, make_app


@pytest.fixture
async def sandbox_url():
    server = await serve_http(make_app(SandboxLimits(timeout_s=5.0)), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.port}/run_code"
    finally:
        await server.stop()


async def test_run_code_speaks_sandboxfusions_contract(sandbox_url):
    async with httpx.AsyncClient(timeout=30) as c:
        r = (await c.post(sandbox_url, json={"code": "import sympy\nprint(sympy.sqrt(8))"})).json()
        assert r["status"] == "Success" and r["run_result"]["stdout"].strip() == "2*sqrt(2)", r
        assert r["run_result"]["return_code"] == 0 and r["run_result"]["status"] == "Finished"
        r = (await c.post(sandbox_url, json={"code": "import urllib.request as u; u.urlopen('http://1.1.1.1')"})).json()
        assert r["status"] == "Failed" and "exit code 1" in r["run_result"]["stdout"]  # no network in there
        t0 = time.monotonic()
        r = (await c.post(sandbox_url, json={"code": "while True: pass", "run_timeout": 1})).json()
        assert r["run_result"]["status"] == "TimeLimitExceeded" and time.monotonic() - t0 < 4, r
        # a web page in the user's browser: another Host (DNS rebinding), or a form post
        r = await c.post(sandbox_url, json={"code": "print(1)"}, headers={"Host": "evil.example"})
        assert r.status_code == 400, r.text
        r = await c.post(sandbox_url, content='{"code": "print(1)"}', headers={"Content-Type": "text/plain"})
        assert r.status_code == 422, r.text
        for body, field in (({"code": "x", "language": "bash"}, "language"),
                            ({"code": "x" * 100_001}, "code"), ({"code": "x", "run_timeout": -1}, "run_timeout")):
            r = await c.post(sandbox_url, json=body)
            assert r.status_code == 422 and field in r.text, (body, r.text)


async def test_code_interpreter_math_game_runs_code_then_scores_the_boxed_answer(sandbox_url):
    game = CodeInterpreterMathGame(sandbox_url=sandbox_url, max_turns=3)
    game.reset(ground_truth="12", extra_info={"index": 5})
    r = await asyncio.to_thread(game.step, "Let me compute.\n```python\nprint(3 * 4)\n```")
    assert (r.observation, r.reward, r.done) == ("12", 0.0, False)
    r = await asyncio.to_thread(game.step, "Nothing to run.")
    assert not r.done and r.info["no_action"] and "```python" in r.observation
    r = await asyncio.to_thread(game.step, "So the answer is \\boxed{12}.")
    assert (r.reward, r.done, r.info["code_executions_count"], r.info["index"]) == (1.0, True, 1, 5)
    assert r.info["execution_history"] == [{"turn": 1, "code": "print(3 * 4)", "output": "12"}]
    # the last turn ends the episode, scored on that reply
    game = CodeInterpreterMathGame(sandbox_url=sandbox_url, max_turns=1)
    game.reset(ground_truth="7")
    r = await asyncio.to_thread(game.step, "```py\nprint(7)\n```")
    assert r.done and r.info["truncated"] and r.reward == 0.0 and r.observation.startswith("7\n\n[Maximum turns")


def test_a_missing_sandbox_is_the_models_observation_not_a_crash():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    game = CodeInterpreterMathGame(sandbox_url=f"http://127.0.0.1:{port}/run_code", timeout=2)
    game.reset(ground_truth="1")
    assert game.step("```python\nprint(1)\n```").observation == "[Error: Cannot connect to sandbox server]"


def test_the_environment_takes_upstreams_constructor(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"prompt": [{"role": "user", "content": "2+2?"}], '
                                      '"reward_model": {"ground_truth": "4"}}\n')
    env = MathCodeInterpreterEnvironment(CodeInterpreterMathGame, {"batch_size": 1}, [str(tmp_path / "t.jsonl")],
                                         job_id="mci")
    assert env.interaction_name == "math_code_interpreter" and env.steps_per_epoch == 1


def test_the_command_serves_on_loopback_only(tmp_path):
    for host in ("0.0.0.0", "example.com", "10.0.0.1"):
        with pytest.raises(ValueError, match="not a loopback address"):
            check_loopback(host)
    assert check_loopback("::1") == "::1" and check_loopback("localhost") == "localhost"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = str(Path(sys.executable).parent / "opentinker")
    proc = subprocess.Popen([exe, "sandbox", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise AssertionError(proc.stdout.read1().decode())
        r = httpx.post(f"http://127.0.0.1:{port}/run_code", json={"code": "print(6*7)"}, timeout=30).json()
        assert r["run_result"]["stdout"].strip() == "42"
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([exe, "sandbox", "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "not a loopback address" in bad.stderr
