"""`code-math` served by a real envhost subprocess: code that never ends or forks
without bound still gets an observation back in time, and the host keeps serving."""

import json
import time

from test_envhost import episode, step

CODE_MATH = "opentinker.services.envhost.envs.code_math:CodeMathGame"


def tool_call(code: str) -> str:
    return f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call>'


async def test_runaway_code_gets_an_observation_and_the_host_keeps_serving(bus, services):
    proc = services.start("envhost", args=["--env", CODE_MATH])
    args = {"source": "arith", "timeout_s": 2, "max_tool_calls": 5}
    state, reset, eid = await episode(bus, "code-math", proc, args, seed=4)
    assert reset.user_message == state["question"] and reset.tools[0]["function"]["name"] == "python"

    for code in ("while True: pass", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"):
        t0 = time.monotonic()
        r = await step(bus, reset, eid, tool_call(code))
        assert time.monotonic() - t0 < 5
        assert (r.error, r.done, r.info["timed_out"]) == ("", False, True)
        assert "timed out after 2 s" in r.observation

    r = await step(bus, reset, eid, tool_call("import os\nwhile True: os.fork()"))
    assert (r.error, r.done) == ("", False) and "process limit of 32 reached" in r.observation

    a, b = state["question"].removeprefix("What is ").removesuffix("?").split(" * ")
    r = await step(bus, reset, eid, tool_call(f"print({a} * {b})"))
    assert r.observation == f"{state['answer']}\n" and r.info["tool_calls"] == 4
    r = await step(bus, reset, eid, f"#### {r.observation.strip()}")
    assert (r.reward, r.done, r.error) == (1.0, True, "")

    # a new episode on the same host is served as usual
    state, reset, eid = await episode(bus, "code-math", proc, args, seed=5)
    r = await step(bus, reset, eid, tool_call("print(6 * 7)"))
    assert r.observation == "42\n" and not r.done
