"""`simulated-user` (services/envhost/envs/simulated_user.py): the policy plays a support
assistant, a model behind an OpenAI-compatible endpoint plays the customer. The endpoint
here is a real HTTP server on 127.0.0.1 (a random port) answering chat completions with
scripted replies; the operator's URL allowlist (services/core/access.py) is checked
through a real EnvHost."""

from __future__ import annotations

import json
import socket
import threading
import time
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from opentinker.schemas import EnvInitRequest, EnvResetRequest, EnvStepRequest
from opentinker.schemas.job import SpecError
from opentinker.services.core.access import Tenant, check_endpoint_args
from opentinker.services.envhost.envs import simulated_user as su
from opentinker.services.envhost.envs.simulated_user import EndpointError, SimulatedUserGame
from opentinker.services.envhost.registry import BUILTIN
from opentinker.services.envhost.service import EnvHost, confine_for_job

KEY_ENV = "OT_TEST_SIMUSER_KEY"


class StubEndpoint:
    """A chat-completions server on 127.0.0.1:<random port>. Each POST to
    /v1/chat/completions is recorded (body and Authorization header) and answered by
    `reply(body)`: a str (the message content), or (status, raw bytes)."""

    def __init__(self):
        self.requests: list[dict[str, Any]] = []
        self.replies: list[Any] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append({"path": self.path, "body": body,
                                      "authorization": self.headers.get("Authorization")})
                got = stub.replies.pop(0) if stub.replies else "(no script left)"
                if isinstance(got, str):
                    status, raw = 200, json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                                "message": {"role": "assistant", "content": got}}]
                                                   }).encode()
                else:
                    status, raw = got
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def script(self, *replies: Any) -> StubEndpoint:
        self.replies[:] = replies
        return self


@pytest.fixture
def endpoint():
    stub = StubEndpoint()
    stub.thread.start()
    yield stub
    stub.server.shutdown()
    stub.server.server_close()


@pytest.fixture
def key(monkeypatch) -> str:
    monkeypatch.setenv(KEY_ENV, "sk-test-123")
    return "sk-test-123"


def game(url: str, **kw: Any) -> SimulatedUserGame:
    return SimulatedUserGame(user_base_url=url, user_model="persona-model", user_api_key_env=KEY_ENV, **kw)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


REFUND = "refund-1234"  # built-in: damaged headphones, order #1234
GOOD = "I'm sorry about that. I have issued a refund for order #1234; it reaches your card in 5-7 business days."


def test_the_env_is_a_builtin():
    assert BUILTIN["simulated-user"] is SimulatedUserGame


def test_a_user_whose_goal_is_met_says_the_stop_marker_and_the_assistant_earns_1(endpoint, key):
    g = game(endpoint.url)
    endpoint.script("It's order #1234, the headphones arrived cracked.", "Perfect, thank you! ###DONE###")
    g.reset(scenario=REFUND)
    opening = g.get_initial_user_message()
    assert "5-7 business days" in g.get_system_prompt()  # the assistant is told the store's policy
    r1 = g.step("Sorry to hear that. What is your order number?")
    assert (r1.observation, r1.reward, r1.done) == ("It's order #1234, the headphones arrived cracked.", 0.0, False)
    r2 = g.step(GOOD)
    assert r2.done and r2.reward == 1.0
    assert "###DONE###" not in r2.observation and r2.observation.startswith("Perfect, thank you!")
    assert r2.info["ended_by"] == "done" and r2.info["missing"] == []

    # what the simulated user saw: its persona, then the conversation with roles flipped
    req = endpoint.requests[-1]
    assert req["path"] == "/v1/chat/completions" and req["authorization"] == f"Bearer {key}"
    body = req["body"]
    assert body["model"] == "persona-model" and body["temperature"] == 0.0
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "###DONE###" in body["messages"][0]["content"]
    assert body["messages"][2]["content"] == opening  # the user's own line is the sim's "assistant"
    assert body["messages"][-1]["content"] == GOOD  # the policy's reply is the sim's "user"


def test_an_assistant_that_never_says_the_required_facts_earns_0(endpoint, key):
    g = game(endpoint.url)
    endpoint.script("Order #1234.", "Fine, whatever. ###STOP###")
    g.reset(scenario=REFUND)
    assert not g.step("What is your order number?").done
    r = g.step("Please contact the manufacturer.")
    assert r.done and r.reward == 0.0 and r.info["ended_by"] == "stop"
    assert r.info["missing"]  # names the facts never said


def test_a_forbidden_phrase_costs_the_reward_even_with_every_fact_said(endpoint, key, tmp_path):
    f = tmp_path / "scenarios.jsonl"
    f.write_text(json.dumps({"id": "s", "persona": "p", "goal": "g", "opening": "hi",
                             "required": ["refund"], "forbidden": ["store credit"]}) + "\n")
    g = game(endpoint.url, scenarios_file=str(f))
    endpoint.script("ok ###DONE###")
    g.reset(scenario="s")
    assert g.step("A refund, or store credit if you like.").reward == 0.0


def test_the_judge_path_asks_a_yes_no_rubric_and_parses_it_strictly(endpoint, key):
    verdicts = {"YES": 1.0, " yes. ": 1.0, "No": 0.0, "Yes, mostly.": 0.0, "": 0.0}
    for verdict, reward in verdicts.items():
        g = game(endpoint.url, reward="judge", judge_model="judge-model")
        endpoint.script("Thanks! ###DONE###", verdict)
        g.reset(scenario=REFUND)
        r = g.step(GOOD)
        assert r.done and r.reward == reward, verdict
        assert r.info["judge_verdict"] == ("unparsed" if verdict.strip(" .").upper() not in ("YES", "NO")
                                           else verdict.strip(" .").upper()), verdict
    judge = endpoint.requests[-1]["body"]
    assert judge["model"] == "judge-model" and judge["temperature"] == 0.0
    prompt = judge["messages"][-1]["content"]
    assert GOOD in prompt and "1234" in prompt and "YES or NO" in prompt


def test_the_episode_ends_at_max_turns_scored_by_the_rule(endpoint, key):
    g = game(endpoint.url, max_turns=2)
    endpoint.script("Order 1234.", "(never asked)")
    g.reset(scenario=REFUND)
    assert not g.step("What is the order number?").done
    r = g.step(GOOD)
    assert r.done and r.reward == 1.0 and r.info["ended_by"] == "max_turns"
    assert len(endpoint.requests) == 1  # the last turn asks the user nothing


async def test_an_unreachable_endpoint_fails_the_episode_naming_the_url_and_the_host_keeps_serving(endpoint, key):
    url = closed_port_url()
    with pytest.raises(EndpointError, match=f"user_base_url {url}.*unreachable"):
        g = game(url, timeout_s=5)
        g.reset(scenario=REFUND)
        g.step("hello")

    host = EnvHost({"simulated-user": SimulatedUserGame}, "h1", 2, 60.0)
    try:
        for ep, base in (("e-down", url), ("e-up", endpoint.url)):
            args = {"user_base_url": base, "user_model": "m", "timeout_s": 5}
            init = await host.init("simulated-user", EnvInitRequest(env="simulated-user", env_args=args, seed=1), None)
            assert not init.error, init
            reset = await host.reset("simulated-user", EnvResetRequest(
                env="simulated-user", episode_id=ep, env_args=args, state=init.state), None)
            assert not reset.error and reset.user_message, reset
        step = await host.step(EnvStepRequest(episode_id="e-down", action="hello"), None)
        assert step.done and url in step.error and step.error.startswith("EndpointError:"), step
        endpoint.script("hi there")
        step = await host.step(EnvStepRequest(episode_id="e-up", action="hello"), None)
        assert not step.error and step.observation == "hi there"
    finally:
        host.shutdown()


@pytest.mark.parametrize("reply, why", [
    ((200, b"not json"), "malformed reply"),
    ((200, b'{"choices": []}'), "no choices"),
    ((200, b'{"choices": [{"message": {"content": null}}]}'), "malformed reply"),
    ((200, b'{"object": "chat.completion"}'), "malformed reply"),
    ((500, b'{"error": {"message": "engine died"}}'), "HTTP 500"),
    ((401, b'{"error": {"message": "bad key"}}'), "HTTP 401"),
])
def test_a_malformed_or_failed_reply_fails_the_step_naming_the_url(endpoint, key, reply, why):
    g = game(endpoint.url)
    endpoint.script(reply)
    g.reset(scenario=REFUND)
    with pytest.raises(EndpointError) as e:
        g.step("hello")
    assert endpoint.url in str(e.value) and why in str(e.value)
    assert key not in str(e.value)


def test_a_reply_over_the_size_limit_is_refused(endpoint, key, monkeypatch):
    monkeypatch.setattr(su, "MAX_REPLY_BYTES", 1000)
    g = game(endpoint.url)
    endpoint.script("x" * 2000)
    g.reset(scenario=REFUND)
    with pytest.raises(EndpointError, match="over 1000 bytes"):
        g.step("hello")


def test_env_args_name_the_field_and_never_hold_a_key(monkeypatch):
    with pytest.raises(ValueError, match="env_args.user_base_url"):
        SimulatedUserGame(user_model="m")
    with pytest.raises(ValueError, match="env_args.user_base_url"):
        SimulatedUserGame(user_base_url="file:///etc/passwd", user_model="m")
    with pytest.raises(ValueError, match="env_args.user_model"):
        SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="env_args.reward"):
        SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m", reward="vibes")
    with pytest.raises(ValueError, match="env_args.user_api_key: .*user_api_key_env"):
        SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m", user_api_key="sk-1")
    with pytest.raises(ValueError, match="env_args.colour"):
        SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m", colour="red")
    monkeypatch.delenv("OT_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ValueError, match="env_args.user_api_key_env: .*OT_TEST_UNSET_KEY.* is not set"):
        SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m", user_api_key_env="OT_TEST_UNSET_KEY")


def test_scenarios_split_by_hash_into_disjoint_train_and_test():
    g = SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m")
    train = {g.generate_initial_state(seed, "train")["scenario"] for seed in range(300)}
    test = {g.generate_initial_state(seed, "test")["scenario"] for seed in range(300)}
    assert train and test and not train & test
    assert train | test == {s.id for s in su.BUILTIN_SCENARIOS}
    assert g.generate_initial_state(7, "test") == g.generate_initial_state(7, "test")
    assert {su.split_of(su.BUILTIN_SCENARIOS, s) for s in test} == {"test"}


def test_a_scenarios_file_replaces_the_built_in_set_and_a_bad_line_is_named(tmp_path):
    f = tmp_path / "scenarios.jsonl"
    rows = [{"id": f"s{i}", "persona": "a shopper", "goal": f"buy item {i}", "opening": f"I want item {i}.",
             "required": [f"item {i}", ["price", "costs"]], "rubric": "Did the assistant sell it?"} for i in range(6)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    g = SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m", scenarios_file=str(f))
    picked = {g.generate_initial_state(s, "train")["scenario"] for s in range(100)}
    assert picked <= {r["id"] for r in rows} and len(picked) == 5  # 6 scenarios: 1 held out
    g.reset(scenario="s3")
    assert g.get_initial_user_message() == "I want item 3."
    with pytest.raises(ValueError, match="scenario: 'nope' is not"):
        g.reset(scenario="nope")

    f.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"id": "x", "persona": "p"}) + "\n")
    with pytest.raises(ValueError, match=r"scenarios\.jsonl:2: .*goal"):
        SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m", scenarios_file=str(f))
    f.write_text(json.dumps({**rows[0], "required": []}) + "\n")
    with pytest.raises(ValueError, match="s0.*required"):
        SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m", scenarios_file=str(f))
    # the judge needs no facts
    SimulatedUserGame(user_base_url="http://127.0.0.1:1/v1", user_model="m", scenarios_file=str(f), reward="judge")


# -- the operator's allowlist ------------------------------------------------------------

ALLOWED = ("http://127.0.0.1:8000/v1", "https://api.example.com")


@pytest.mark.parametrize("url, ok", [
    ("http://127.0.0.1:8000/v1", True),
    ("http://127.0.0.1:8000/v1/", True),
    ("http://127.0.0.1:8000/v1/jobs/j1/v1", True),
    ("https://api.example.com/v1", True),
    ("https://API.example.com:443/v1", True),
    ("http://127.0.0.1:8000/v1x", False),            # a path prefix only on a segment boundary
    ("http://127.0.0.1:8000/", False),
    ("http://127.0.0.1:8001/v1", False),             # another port
    ("https://127.0.0.1:8000/v1", False),            # another scheme
    ("http://api.example.com/v1", False),
    ("https://api.example.com.evil.net/v1", False),  # a host prefix
    ("https://api.example.com@evil.net/v1", False),  # user info: the host is evil.net
    ("http://169.254.169.254/latest", False),
    ("not a url", False),
])
def test_a_tenants_url_must_be_on_the_operators_allowlist(url, ok):
    args = {"user_base_url": url, "user_model": "m"}
    if ok:
        assert check_endpoint_args(args, admin=False, allowed_urls=ALLOWED, allowed_key_envs=()) == args
    else:
        with pytest.raises(SpecError) as e:
            check_endpoint_args(args, admin=False, allowed_urls=ALLOWED, allowed_key_envs=())
        assert e.value.field == "env_args.user_base_url" and "envhost_allowed_urls" in e.value.reason
    # an admin's (and the operator's own) job names any URL
    assert check_endpoint_args(args, admin=True, allowed_urls=(), allowed_key_envs=()) == args


def test_a_tenant_names_only_the_key_variables_the_operator_lends():
    args = {"judge_base_url": ALLOWED[0], "judge_api_key_env": "NATS_NKEY"}
    with pytest.raises(SpecError) as e:
        check_endpoint_args(args, admin=False, allowed_urls=ALLOWED, allowed_key_envs=("SIMUSER_KEY",))
    assert e.value.field == "env_args.judge_api_key_env" and "envhost_allowed_key_envs" in e.value.reason
    ok = {**args, "judge_api_key_env": "SIMUSER_KEY"}
    assert check_endpoint_args(ok, admin=False, allowed_urls=ALLOWED, allowed_key_envs=("SIMUSER_KEY",)) == ok
    with pytest.raises(SpecError, match="must be a string"):
        check_endpoint_args({"user_base_url": ["x"]}, admin=False, allowed_urls=ALLOWED, allowed_key_envs=())


async def test_an_operator_envhost_refuses_a_tenants_url_off_the_allowlist(endpoint, tmp_path):
    host = EnvHost({"simulated-user": SimulatedUserGame}, "h1", 2, 60.0)
    home = tmp_path / "home"
    (home / "users" / "alice").mkdir(parents=True)

    # what body() sets, with the owner of job a-1 (alice, no admin) already read from KV
    owners = {"a-1": (time.monotonic(), Tenant(user="alice", admin=False, own_jobs=frozenset({"a-1"})))}
    host.confine = partial(confine_for_job, None, str(home), owners, allowed_urls=(endpoint.url,))
    try:
        bad = {"user_base_url": "http://169.254.169.254/latest", "user_model": "m"}
        init = await host.init("simulated-user", EnvInitRequest(env="simulated-user", env_args=bad, job_id="a-1"),
                               None)
        reset = await host.reset("simulated-user", EnvResetRequest(
            env="simulated-user", episode_id="e", job_id="a-1", env_args=bad, state={"scenario": REFUND}), None)
        for reply in (init, reset):
            assert "env_args.user_base_url" in reply.error and "envhost_allowed_urls" in reply.error, reply
        assert not host.episodes and not endpoint.requests
        good = {"user_base_url": endpoint.url, "user_model": "m"}
        init = await host.init("simulated-user", EnvInitRequest(env="simulated-user", env_args=good, job_id="a-1"),
                               None)
        assert not init.error, init
        # the operator's own call (no job) names any URL
        init = await host.init("simulated-user", EnvInitRequest(env="simulated-user", env_args=bad), None)
        assert not init.error, init
    finally:
        host.shutdown()
