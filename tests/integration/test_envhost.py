"""envhost as a real subprocess against a real nats-server: built-in envs, a user's env
file, errors in user code, dead letters, and several hosts sharing episodes."""

import asyncio
import itertools
import shutil
import uuid
from pathlib import Path

import nats
import pyarrow.parquet as pq
import pytest
from nats.js.api import DeliverPolicy

from opentinker.schemas import (
    DeadLetter,
    EnvCloseRequest,
    EnvInitReply,
    EnvInitRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvStepReply,
    EnvStepRequest,
    decode,
)
from opentinker.schemas import subjects as S
from opentinker.services.envhost.envs.arith import answer_of
from opentinker.services.envhost.envs.gsm8k import prepare_gsm8k
from opentinker.services.envhost.service import EnvHost
from fixtures.gsm8k_data import SAMPLE as GSM8K_SAMPLE

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "user_env.py"


async def ask(bus, subject, msg, reply_type, proc, timeout_s=60.0):
    """Request, retrying while nothing serves `subject` yet (the host is starting)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await bus.request(subject, msg, reply_type, timeout_s=10)
        except nats.errors.NoRespondersError:
            assert proc.poll() is None, "envhost exited"
            assert loop.time() < deadline, f"nothing serves {subject}"
            await asyncio.sleep(0.2)


async def episode(bus, env, proc, env_args=None, seed=0, split="train"):
    """init + reset one episode; returns (state, EnvResetReply, episode_id)."""
    env_args = env_args or {}
    init = await ask(bus, S.env_init(env), EnvInitRequest(env=env, env_args=env_args, seed=seed,
                                                          split=split), EnvInitReply, proc)
    assert init.error == ""
    eid = f"ep-{uuid.uuid4().hex[:8]}"
    reset = await bus.request(S.env_reset(env), EnvResetRequest(
        env=env, episode_id=eid, env_args=env_args, state=init.state), EnvResetReply)
    assert reset.error == "" and reset.host_id
    return init.state, reset, eid


async def step(bus, reset, eid, action):
    return await bus.request(S.env_step(reset.host_id), EnvStepRequest(episode_id=eid, action=action),
                             EnvStepReply)


@pytest.fixture
def gsm8k_dir(tmp_path):
    src = tmp_path / "gsm8k-src"
    src.mkdir()
    with open(GSM8K_SAMPLE / "test.jsonl") as f:
        (src / "test.jsonl").write_text("".join(itertools.islice(f, 10)))
    prepare_gsm8k(src, tmp_path / "gsm8k")
    return tmp_path / "gsm8k"


async def test_builtin_envs_over_the_bus(bus, services, gsm8k_dir):
    proc = services.start("envhost")

    state, reset, eid = await episode(bus, "arith", proc, {"op": "mul"}, seed=7)
    assert "Reply with only the number" in reset.user_message and reset.system_prompt
    r = await step(bus, reset, eid, str(answer_of("mul", state["a"], state["b"])))
    assert (r.reward, r.done, r.error) == (1.0, True, "")
    gone = await step(bus, reset, eid, "1")  # a done episode is dropped
    assert "not open" in gone.error and gone.done

    args = {"data_dir": str(gsm8k_dir)}
    state, reset, eid = await episode(bus, "gsm8k", proc, args, seed=1, split="test")
    final = pq.read_table(gsm8k_dir / "test.parquet").column("final")[state["index"]].as_py()
    assert reset.user_message and "####" in reset.system_prompt
    r = await step(bus, reset, eid, f"Let me think.\n#### {final}")
    assert (r.reward, r.done) == (1.0, True)

    state, reset, eid = await episode(bus, "guess-number", proc, {"n": 16, "max_turns": 6}, seed=3)
    target = state["target"]
    wrong = 1 if target != 1 else 2
    r = await step(bus, reset, eid, str(wrong))
    assert not r.done and r.reward == 0.0
    assert r.observation.startswith("Higher" if wrong < target else "Lower")
    r = await step(bus, reset, eid, str(target))
    assert (r.reward, r.done, r.observation) == (1.0, True, "Correct!")

    # a bad env_arg is the user's error, reported, and the host keeps going
    bad = await bus.request(S.env_init("arith"), EnvInitRequest(env="arith", env_args={"op": "div"}),
                            EnvInitReply)
    assert bad.error.startswith("ValueError") and "op" in bad.error
    assert (await bus.request(S.env_init("arith"), EnvInitRequest(env="arith"), EnvInitReply)).state


async def test_user_env_file_outside_the_package(bus, services, tmp_path, monkeypatch):
    userland = tmp_path / "userland"
    userland.mkdir()
    shutil.copy(FIXTURE, userland / "my_games.py")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    proc = services.start("envhost", args=["--env", f"{userland / 'my_games.py'}:EchoGame",
                                           "--env", f"{userland / 'my_games.py'}:FlakyGame"])

    state, reset, eid = await episode(bus, "user-echo", proc, {"shout": True}, seed=1)
    word = state["word"].upper()
    # no initial user message in the class: the first observation stands in
    assert reset.user_message == f"Say the word {word}."
    assert reset.system_prompt == "Repeat what you are told."
    r = await step(bus, reset, eid, word)
    assert r.reward == 1.0 and r.info == {"expected": word, "3": "int key"}

    # an exception in step ends that episode with the reason; the host keeps serving
    _, reset, eid = await episode(bus, "user-flaky", proc)
    assert (await step(bus, reset, eid, "hello")).observation == "you said hello"
    boom = await step(bus, reset, eid, "boom")
    assert boom.done and boom.error == "RuntimeError: the env exploded"
    assert "not open" in (await step(bus, reset, eid, "hello")).error
    bad_reset = await bus.request(S.env_reset("user-flaky"), EnvResetRequest(
        env="user-flaky", episode_id="x", state={"fail": True}), EnvResetReply)
    assert bad_reset.error == "ValueError: cannot reset: fail=True"
    _, reset, eid = await episode(bus, "user-flaky", proc)
    assert (await step(bus, reset, eid, "again")).observation == "you said again"

    # a slow env does not hold up the host: another episode is served meanwhile
    gate = tmp_path / "gate"
    slow = asyncio.create_task(step(bus, reset, eid, f"wait:{gate}"))
    _, reset2, eid2 = await episode(bus, "user-echo", proc)
    assert (await step(bus, reset2, eid2, "apple")).done
    assert not slow.done()
    gate.touch()
    assert (await slow).observation == "waited"


async def test_module_import_with_env_path(bus, services, tmp_path, monkeypatch):
    shutil.copy(FIXTURE, tmp_path / "my_games.py")
    monkeypatch.chdir(Path("/"))
    proc = services.start("envhost", args=["--env", "my_games:EchoGame", "--name", "echo-renamed",
                                           "--env-path", str(tmp_path)])
    state, reset, eid = await episode(bus, "echo-renamed", proc)
    assert (await step(bus, reset, eid, state["word"])).reward == 1.0


def test_a_bad_env_spec_exits_with_the_reason(services, tmp_path):
    proc = services.start("envhost", args=["--env", f"{FIXTURE}:NoSuchGame"])
    assert proc.wait(60) == 2
    assert "has no attribute 'NoSuchGame'" in services.logs(tail=None)


async def test_undecodable_request_is_dead_lettered_and_host_keeps_serving(bus, services, job_id):
    proc = services.start("envhost", args=["--env", "arith"])
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("envhost")),
                            deliver_policy=DeliverPolicy.NEW)
    await episode(bus, "arith", proc)  # the host is up
    with pytest.raises(nats.errors.TimeoutError):
        await bus.nc.request(S.env_reset("arith"), b"\xc1 not msgpack", timeout=2)
    with pytest.raises(nats.errors.TimeoutError):  # a required field missing
        await bus.nc.request(S.env_init("arith"), b"\x80", timeout=2)
    recs = [decode(m.data, DeadLetter) for m in await bus.fetch(dlq, 10, 5)]
    assert {r.subject for r in recs} == {S.env_reset("arith"), S.env_init("arith")}
    assert any("EnvInitRequest" in r.reason and "env" in r.reason for r in recs)
    state, reset, eid = await episode(bus, "arith", proc, seed=11)
    r = await step(bus, reset, eid, str(state["a"] + state["b"]))
    assert r.reward == 1.0


async def test_two_hosts_share_load_and_steps_go_to_the_owner(bus, services, job_id):
    hosts = [f"{job_id}-h{i}" for i in range(2)]
    procs = [services.start("envhost", f"worker_id={h}", args=["--env", "arith"]) for h in hosts]
    for h, p in zip(hosts, procs):  # wait until each host answers on its own subject
        await ask(bus, S.env_close(h), EnvCloseRequest(episode_id="none"), EnvStepReply, p)

    opened = [await episode(bus, "arith", procs[0], seed=s) for s in range(24)]
    owners = [reset.host_id for _, reset, _ in opened]
    assert set(owners) == set(hosts)  # the queue group spread the resets

    state, reset, eid = opened[0]
    other = next(h for h in hosts if h != reset.host_id)
    stray = await bus.request(S.env_step(other), EnvStepRequest(episode_id=eid, action="0"), EnvStepReply)
    assert "not open" in stray.error
    replies = await asyncio.gather(*(step(bus, reset, eid, str(s["a"] + s["b"]))
                                     for s, reset, eid in opened))
    assert all(r.reward == 1.0 and r.error == "" for r in replies)


async def test_close_and_idle_episodes_are_dropped():
    from opentinker.services.envhost.envs.arith import ArithGame

    host = EnvHost({"arith": ArithGame}, "h", max_concurrency=2, episode_ttl_s=60)
    for eid in ("a", "b"):
        req = EnvResetRequest(env="arith", episode_id=eid, state={"a": 1, "b": 2})
        r = await host.reset("arith", req, None)
        assert r.host_id == "h"
    await host.close(EnvCloseRequest(episode_id="a"), None)
    assert set(host.episodes) == {("", "b")}
    assert host.sweep(now=host.episodes[("", "b")].last_used + 30) == 0
    assert host.sweep(now=host.episodes[("", "b")].last_used + 61) == 1
    assert "not open" in (await host.step(EnvStepRequest(episode_id="b", action="3"), None)).error
    host.shutdown()


async def test_every_way_an_episode_ends_closes_its_game_once_and_a_failing_close_harms_nothing():
    """AbstractGame.close(): called when the episode ends (done), fails, is closed by the
    rollout, idles past the TTL or is reset again under its id; a close() that raises is
    logged, and the host goes on serving."""
    from opentinker.services.envhost.envs.arith import ArithGame

    closed: list[str] = []

    class Closing(ArithGame):
        def reset(self, **state):
            self.label = state.pop("label")
            return super().reset(**state)

        def step(self, action):
            if action == "boom":
                raise RuntimeError("boom")
            return super().step(action)

        def close(self):
            closed.append(self.label)
            if self.label == "idle":
                raise OSError("a close that fails")

    host = EnvHost({"arith": Closing}, "h", max_concurrency=2, episode_ttl_s=60)

    async def reset(eid, label):
        req = EnvResetRequest(env="arith", episode_id=eid, state={"a": 1, "b": 2, "label": label})
        assert (await host.reset("arith", req, None)).host_id == "h"

    async def settled(n):  # close() runs in a user-code thread, not awaited by the host
        for _ in range(100):
            if len(closed) >= n:
                return sorted(closed)
            await asyncio.sleep(0.02)
        return sorted(closed)

    for eid in ("done", "failed", "closed", "idle", "again"):
        await reset(eid, eid)
    assert (await host.step(EnvStepRequest(episode_id="done", action="3"), None)).done
    assert "boom" in (await host.step(EnvStepRequest(episode_id="failed", action="boom"), None)).error
    await host.close(EnvCloseRequest(episode_id="closed"), None)
    await reset("again", "replaced")  # the first "again" game is replaced
    assert await settled(4) == ["again", "closed", "done", "failed"]
    host.episodes[("", "idle")].last_used -= 120
    assert host.sweep() == 1 and await settled(5) == ["again", "closed", "done", "failed", "idle"]
    # the failing close() was logged; the host still serves the replacing game
    assert (await host.step(EnvStepRequest(episode_id="again", action="3"), None)).reward == 1.0
    assert await settled(6) == ["again", "closed", "done", "failed", "idle", "replaced"]
    host.shutdown()


async def test_one_jobs_episode_ids_never_reach_another_jobs_games():
    """Episode ids come from request ids a job chooses; a job naming another job's
    episode id (even the exact one) must not step, close or overwrite that game."""
    from opentinker.services.envhost.envs.arith import ArithGame

    host = EnvHost({"arith": ArithGame}, "h", max_concurrency=2, episode_ttl_s=60)
    eid = "victim-s7-g0-e0"
    await host.reset("arith", EnvResetRequest(env="arith", episode_id=eid, job_id="victim",
                                              state={"a": 1, "b": 2}), None)
    game = host.episodes[("victim", eid)].game
    # the attacker resets, steps and closes under the same episode id in its own job
    await host.reset("arith", EnvResetRequest(env="arith", episode_id=eid, job_id="attacker",
                                              state={"a": 5, "b": 5}), None)
    assert host.episodes[("victim", eid)].game is game  # not overwritten
    await host.close(EnvCloseRequest(episode_id=eid, job_id="attacker"), None)
    stray = await host.step(EnvStepRequest(episode_id=eid, job_id="attacker", action="3"), None)
    assert "not open" in stray.error and ("victim", eid) in host.episodes
    # the victim's own episode goes on: 1 + 2 = 3 is right
    reply = await host.step(EnvStepRequest(episode_id=eid, job_id="victim", action="3"), None)
    assert reply.done and reply.reward == 1.0 and not reply.error
    host.shutdown()
