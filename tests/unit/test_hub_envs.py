"""Environment-hub adapters: envs written against verifiers' and OpenEnv's own APIs
(tests/fixtures/hub_envs.py), served through `--env verifiers:...` / `--env openenv...`
and driven by the envhost's own episode functions."""

import json
import threading
import time
from pathlib import Path

import pytest

from opentinker.services.envhost.loader import EnvLoadError, load_class, load_envs
from opentinker.services.envhost.service import initial_state, open_episode, take_step

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
F = FIXTURES / "hub_envs.py"


@pytest.fixture(scope="module")
def hub():
    import sys

    envs = load_envs([f"verifiers:{F}:load_single", f"verifiers:{F}:load_environment",
                      f"verifiers:{F}:load_tools", f"openenv:{F}:CountEnvironment?low=2&high=3"])
    # the fixture module as the adapters imported it (reward functions to recompute with)
    mod = next(m for n, m in sys.modules.items() if n.startswith("opentinker_user_env_hub_envs_"))
    return envs, mod


def episode(cls, seed=0, split="train"):
    state = initial_state(cls, {}, seed, split)
    return (state, *open_episode(cls, {}, state))


def test_specs_name_the_served_envs(hub):
    envs, _ = hub
    assert set(envs) == {"hub_envs-single", "hub_envs", "hub_envs-tools", "count"}


def test_single_turn_reward_is_the_rubrics_weighted_score(hub):
    envs, mod = hub
    cls = envs["hub_envs-single"]
    for seed, reply in [(0, "7"), (1, "the answer is 12"), (2, "")]:
        state, game, system, user, tools = episode(cls, seed)
        question = next(q for q in mod.QUESTIONS if q["question"] == user)
        assert system == "Answer with a single number." and tools == []
        r = take_step(game, reply)
        completion = [{"role": "assistant", "content": reply}]
        c, b = mod.correct(completion, question["answer"]), mod.brevity(completion)
        assert r.done and r.observation == ""
        assert r.reward == pytest.approx(1.0 * c + 0.5 * b)
        assert r.info["metrics"]["correct"] == c and r.info["metrics"]["brevity"] == pytest.approx(b)
        assert r.info["answer"] == question["answer"]
    # a right answer scores 1 + 0.5 / 2
    state, game, system, user, tools = episode(cls, 3)
    answer = next(q for q in mod.QUESTIONS if q["question"] == user)["answer"]
    assert take_step(game, answer).reward == pytest.approx(1.25)


def test_splits_draw_from_dataset_and_eval_dataset(hub):
    envs, mod = hub
    cls = envs["hub_envs-single"]
    train = {episode(cls, s)[3] for s in range(40)}
    test = {episode(cls, s, "test")[3] for s in range(20)}
    assert train == {q["question"] for q in mod.QUESTIONS[:8]}
    assert test == {q["question"] for q in mod.QUESTIONS[8:]}
    assert episode(cls, 5)[3] == episode(cls, 5)[3]  # a group seed is one problem
    # without an eval_dataset, a seeded tenth of the data is held out of training
    multi = envs["hub_envs"]
    held = {episode(multi, s, "test")[0]["row"] for s in range(20)}
    trained = {episode(multi, s)[0]["row"] for s in range(60)}
    assert len(held) == 1 and not held & trained and len(trained) == 8


def test_multi_turn_env_answers_each_turn_and_stops_itself(hub):
    envs, mod = hub
    cls = envs["hub_envs"]
    state, game, system, user, tools = episode(cls, 4)
    target = int(cls.hub_rows["train"][0][state["row"]]["answer"])
    assert user.startswith("Guess my number")
    wrong = 1 if target != 1 else 2
    r = take_step(game, str(wrong))
    assert not r.done and r.reward == 0 and r.observation == ("Higher." if wrong < target else "Lower.")
    r = take_step(game, "no idea")
    assert not r.done and r.observation == "Not a number."
    r = take_step(game, f"It is {target}")
    # the env's own stop condition; reward = guessed_in - 0.1 * turns
    assert r.done and r.info["stop_condition"] == "guessed"
    assert r.reward == pytest.approx(1.0 - 0.1 * 3)
    # max_turns: three wrong guesses end it with the rubric's score
    state, game, *_ = episode(cls, 4)
    rs = [take_step(game, str(wrong)) for _ in range(3)]
    assert [x.done for x in rs] == [False, False, True]
    assert rs[-1].info["stop_condition"] == "max_turns_reached" and rs[-1].reward == pytest.approx(-0.3)


def test_tool_env_runs_the_models_tool_calls(hub):
    envs, mod = hub
    cls = envs["hub_envs-tools"]
    state, game, system, user, tools = episode(cls, 2)
    assert [t["function"]["name"] for t in tools] == ["add"]
    assert tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    q = next(q for q in mod.QUESTIONS if q["question"] == user)
    a, b = (int(x) for x in q["question"].removeprefix("What is ").rstrip("?").split(" + "))
    call = f'Let me add.\n<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    r = take_step(game, call)
    assert not r.done and r.observation == str(a + b)  # run by the verifiers env
    r = take_step(game, q["answer"])  # no tool call: ToolEnv stops
    assert r.done and r.info["stop_condition"] == "no_tools_called"
    assert r.reward == pytest.approx(1.0 + 0.25)
    assert r.info["metrics"]["add_calls"] == 1.0
    # arguments that are not JSON: the env answers with its error formatter's text
    state, game, *_ = episode(cls, 2)
    r = take_step(game, '<tool_call>{"name": "add", "arguments": not json}</tool_call>')
    assert not r.done and r.observation and r.observation != str(a + b)
    r = take_step(game, "no tool, no answer")
    assert r.done and r.reward == 0.25


def test_openenv_environment_reward_done_and_state(hub):
    envs, mod = hub
    cls = envs["count"]
    state, game, system, user, tools = episode(cls, 11)
    target = int(user.split()[3])
    assert 2 <= target <= 3 and user == f"Reply with exactly {target} words."
    assert episode(cls, 11)[3] == user
    assert episode(cls, 11, "test")[0]["seed"] != state["seed"]  # test seeds are another range
    r = take_step(game, "one")
    assert not r.done and r.reward == pytest.approx(mod.count_reward("one", target))
    assert r.observation == f"You said 1 words; say {target}."
    assert r.info["state"]["said"] == ["one"] and r.info["state"]["step_count"] == 1
    assert r.info["metadata"] == {"words": 1}
    r = take_step(game, " ".join(["w"] * target))
    assert r.done and r.reward == 1.0


def test_openenv_action_function_from_the_operator(tmp_path):
    (tmp_path / "acts.py").write_text(
        "import hub_envs\n"
        "def shout(text):\n    return hub_envs.SayAction(message=text.upper() + ' twice')\n")
    cls = load_class("openenv:hub_envs:CountEnvironment?low=1&high=1&action=acts:shout",
                     [str(FIXTURES), str(tmp_path)])
    _, game, *_ = episode(cls, 0)
    r = take_step(game, "x")
    assert r.info["state"]["said"] == ["X twice"] and r.reward == pytest.approx(0.5)


def test_verifiers_env_id_loads_through_load_environment_with_operator_kwargs():
    cls = load_class("verifiers:hub-envs?max_turns=1", [str(FIXTURES)])
    assert cls.name == "hub-envs"
    _, game, *_ = episode(cls, 0)
    r = take_step(game, "0")
    assert r.done and r.info["stop_condition"] == "max_turns_reached"


def test_job_env_args_are_refused(hub):
    envs, _ = hub
    for name in ("hub_envs-single", "count"):
        with pytest.raises(ValueError, match="env_args"):
            initial_state(envs[name], {"module": "os"}, 0, "train")
        with pytest.raises(ValueError, match="env_args"):
            open_episode(envs[name], {"max_turns": 9}, {})


def test_bad_hub_specs_name_the_problem():
    with pytest.raises(EnvLoadError, match="group-level"):
        load_class(f"verifiers:{F}:load_group_scored")
    with pytest.raises(EnvLoadError, match="no function"):
        load_class(f"verifiers:{F}:nope")
    with pytest.raises(EnvLoadError, match="not an OpenEnv Environment"):
        load_class(f"openenv:{F}:SayAction")
    with pytest.raises(EnvLoadError, match="not a module:function"):
        load_class(f"openenv:{F}:CountEnvironment?action=nope")
    with pytest.raises(EnvLoadError, match="twice"):
        load_class(f"openenv:{F}:CountEnvironment?low=1&low=2")


def test_openenv_server_through_its_http_client(hub):
    """The same Environment behind OpenEnv's own server, reached as openenv+http://."""
    import socket

    import uvicorn
    from openenv.core.env_server import create_fastapi_app

    envs, mod = hub
    env_cls = envs["count"].hub_cls
    app = create_fastapi_app(lambda: env_cls(low=2, high=2), mod.SayAction, mod.CountObservation,
                             max_concurrent_envs=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        cls = load_class(f"openenv+http://127.0.0.1:{port}")
        assert cls.name == f"openenv-127-0-0-1-{port}"
        _, game, system, user, tools = episode(cls, 3)
        assert user == "Reply with exactly 2 words."
        r = take_step(game, "one")
        assert not r.done and r.reward == pytest.approx(0.5) and r.observation == "You said 1 words; say 2."
        r = take_step(game, "one two")
        assert r.done and r.reward == 1.0
        assert json.loads(json.dumps(r.info))["turn"] == 2
    finally:
        server.should_exit = True
        t.join(10)


def test_tool_call_formats_become_openai_tool_calls():
    from opentinker.services.envhost.envs.hub_verifiers import assistant_message

    qwen = assistant_message('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', True)
    assert qwen["content"] == "Sure."
    assert qwen["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    llama = assistant_message('{"name": "add", "parameters": {"a": 1, "b": 2}}', True)
    assert llama["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert "tool_calls" not in assistant_message('{"name": "add", "parameters": {}}', False)
    assert "tool_calls" not in assistant_message("The answer is 3.", True)


def test_a_missing_hub_library_names_its_pip_package():
    import subprocess
    import sys

    code = ("import sys; sys.modules['verifiers'] = None; sys.modules['openenv'] = None\n"
            "from opentinker.services.envhost.loader import EnvLoadError, load_class\n"
            "for s in ('verifiers:my-env', 'openenv:m:C', 'openenv+http://127.0.0.1:1'):\n"
            "    try:\n        load_class(s)\n    except EnvLoadError as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    lines = out.splitlines()
    assert len(lines) == 3, out
    assert "'verifiers:my-env'" in lines[0] and "pip install 'verifiers==" in lines[0]
    assert all("pip install openenv-core" in x for x in lines[1:])
