"""Tenants' own environments, tried as a hostile tenant would, on the shared stack of
tests/tenants.py (an authenticating nats-server, every service its own process).

Alice serves her env `mygame` from her own process with only her API key (`opentinker
envhost --env tenant_games.py:SumGame --name mygame`, no service credentials): her jobs
train on it. Bob can neither subscribe to her env subjects nor answer her requests; naming
her env gets the refusal a nonexistent env gets; his own env of that name serves his jobs
only. A hostile env of bob's (a reply over the limits, a NaN reward, a step that never
answers, an undecodable reply followed by a flood of valid ones, a reset naming alice's
host, a 100 MiB observation) fails only bob's job, with the reasons, while alice's job on her own env completes
every step, and no service exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from pathlib import Path

import nats
import pytest

from opentinker.schemas import (
    EnvInfoReply, EnvInfoRequest, EnvInitReply, EnvInitRequest, EnvResetReply, EnvResetRequest, EnvStepReply,
    EnvStepRequest, JobState, Trajectory, decode, encode,
)
from opentinker.schemas import subjects as S
from opentinker.sdk.client import SpecError

from tenants import dead_letters, user_connection

pytestmark = pytest.mark.timeout(900)
GAMES = Path(__file__).resolve().parents[1] / "fixtures" / "tenant_games.py"
HOSTILE_MODES = ("huge", "nan", "stall", "flood", "hijack", "100mib")
TRAINED: dict[str, str] = {}  # user -> a job of theirs that trained on their own env


def spec(w, name: str, env: str, steps: int, **kw) -> dict:
    return {"name": name, "model": w.tiny_model, "env": env, "engine": "hf", "steps": steps,
            "prompts_per_step": 2, "group_size": 2, "lora_rank": 4, "checkpoint_every": 100,
            "micro_batch_size": 4, "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}, **kw}


async def info(w, env: str, owner: str) -> EnvInfoReply | None:
    try:
        return await w.service.request(S.env_info(env, owner), EnvInfoRequest(env=env), EnvInfoReply, timeout_s=2)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return None


@pytest.fixture(scope="module")
async def alice_env(world):
    """Alice's envhost: the CLI, her key and the REST API's URL only (no service nkey)."""
    proc = world.services.start(
        "envhost", args=["--env", f"{GAMES}:SumGame", "--name", "mygame"],
        env={"NATS_NKEY": "", "OPENTINKER_API_KEY": world.alice_key, "OPENTINKER_API_URL": world.api_url})
    for _ in range(300):
        got = await info(world, "mygame", "alice")
        if got is not None:
            break
        assert proc.poll() is None, world.services.logs()
        await asyncio.sleep(0.2)
    assert got is not None and got.env == "mygame", world.services.logs()
    yield got.host_id
    proc.terminate()


async def trajectories(w, job_id: str) -> list[Trajectory]:
    return await w.service.read_subject(S.job(job_id, "traj"), Trajectory)


async def test_bob_can_neither_subscribe_to_nor_answer_alices_env_subjects(world, alice_env):
    nc, errors = await user_connection(world.server.url, world.bob_key)
    got: list = []

    async def take(m):
        got.append(m)

    for subject in (S.tenant_envs("alice"), "ot.env.user.*.mygame.>", "ot.env.>", S.env_step(alice_env, "alice")):
        await nc.subscribe(subject, cb=take)
    await nc.publish("_R_.ABCDEF.xyz", encode(EnvStepReply(reward=1.0)))  # a made-up reply subject
    await nc.publish(S.env_init("mygame", "alice"), encode(EnvInitRequest(env="mygame")))
    await nc.flush()
    # a request of the services to alice's env still reaches alice, and only alice
    reply = await world.service.request(S.env_init("mygame", "alice"), EnvInitRequest(env="mygame", seed=3),
                                        EnvInitReply, timeout_s=10)
    await asyncio.sleep(1.0)
    await nc.close()
    assert set(reply.state) == {"a", "b"} and not got
    violations = [e for e in errors if "permissions violation" in e.lower()]
    assert len(violations) == 6, errors  # 4 subscriptions, 2 publishes


async def test_naming_alices_env_is_refused_as_a_nonexistent_one_and_bobs_own_of_that_name_serves_bob(
        world, alice_env):
    from opentinker.services.envhost.loader import load_class
    from opentinker.services.envhost.tenant import start_in_thread

    BobSumGame = load_class(f"{GAMES}:BobSumGame")

    refusals = []
    for env in ("mygame", "no-such-env"):
        with pytest.raises(SpecError) as e:
            await world.bob.submit(spec(world, "bob-steal", env, 1))
        refusals.append((e.value.field, str(e.value).replace(env, "<env>")))
    assert refusals[0] == refusals[1] and refusals[0][0] == "env", refusals
    # the operator's env of a name stays open to everyone
    job = await world.bob.submit(spec(world, "bob-op", "arith", 1))
    assert (await job.record()).env_owner == ""
    await job.cancel("only the record was wanted")
    # bob's own `mygame`, served from his own process: his job runs on it, never alice's
    host = await asyncio.to_thread(start_in_thread, {"mygame": BobSumGame}, nats_url=world.server.url,
                                   api_key=world.bob_key, api_url=world.api_url)
    try:
        assert host.user == "bob"
        job = await world.bob.submit(spec(world, "bob-own", "mygame", 1))
        assert (await job.record()).env_owner == "bob"
        rec = await job.wait(timeout_s=300, raise_on_failure=False)
        assert rec.state == JobState.COMPLETED, (rec.reason, world.services.logs())
        served = {t.env_info.get("served_by") for t in await trajectories(world, job.id)}
        assert served == {"bob"}, served
    finally:
        await asyncio.to_thread(host.stop)


class HostileEnv:
    """Bob's envhost, written by hand against the bus (what a hostile tenant could run):
    each group's init hands out the next misbehaviour of HOSTILE_MODES."""

    def __init__(self, nc, env: str, alice_host: str):
        self.nc, self.env, self.alice_host = nc, env, alice_host
        self.modes = itertools.cycle(HOSTILE_MODES)
        self.mode_of: dict[str, str] = {}

    async def start(self) -> None:
        base = f"{S.TENANT_ENVS}.bob"
        for subject, cb in ((S.env_info(self.env, "bob"), self.on_info), (S.env_init(self.env, "bob"), self.on_init),
                            (S.env_reset(self.env, "bob"), self.on_reset), (f"{base}.host.bob-evil.>", self.on_step)):
            await self.nc.subscribe(subject, cb=cb)
        await self.nc.flush()

    async def on_info(self, m) -> None:
        await m.respond(encode(EnvInfoReply(env=self.env, host_id="bob-evil")))

    async def on_init(self, m) -> None:
        decode(m.data, EnvInitRequest)
        await m.respond(encode(EnvInitReply(state={"mode": next(self.modes)})))

    async def on_reset(self, m) -> None:
        req = decode(m.data, EnvResetRequest)
        mode = self.mode_of[req.episode_id] = str(req.state.get("mode"))
        host = self.alice_host if mode == "hijack" else "bob-evil"
        await m.respond(encode(EnvResetReply(host_id=host, system_prompt="Say anything.", user_message="Go.")))

    async def on_step(self, m) -> None:
        if not m.subject.endswith(".step"):
            return
        mode = self.mode_of.get(decode(m.data, EnvStepRequest).episode_id, "")
        if mode == "huge":
            await m.respond(encode(EnvStepReply(observation="x" * 300_000, reward=1.0)))
        elif mode == "100mib":  # over the connection's payload limit: it never leaves bob's machine
            with contextlib.suppress(nats.errors.MaxPayloadError):
                await m.respond(encode(EnvStepReply(observation="x" * (100 * 1024 * 1024), reward=1.0)))
        elif mode == "nan":
            await m.respond(encode(EnvStepReply(reward=float("nan"))))
        elif mode == "flood":  # only the first reply reaches the rollout: the rest are refused
            await self.nc.publish(m.reply, b"\xc1 not msgpack")
            for _ in range(50):
                await self.nc.publish(m.reply, encode(EnvStepReply(reward=1.0)))
        # "stall": never answers


async def test_a_hostile_env_fails_only_its_own_job_while_alice_trains_on_her_own(world, alice_env):
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))

    since = time.time()
    nc = await nats.connect(world.server.url, token=world.bob_key, error_cb=on_error, max_reconnect_attempts=-1)
    hostile = HostileEnv(nc, "evil", alice_env)
    await hostile.start()
    try:
        alice = await world.alice.submit(spec(world, "alice-own", "mygame", 3))
        bob = await world.bob.submit(spec(world, "bob-evil", "evil", 2, prompts_per_step=6, rollout_timeout_s=4))
        assert (await alice.record()).env_owner == "alice" and (await bob.record()).env_owner == "bob"
        a_rec, b_rec = await asyncio.gather(alice.wait(timeout_s=600, raise_on_failure=False),
                                            bob.wait(timeout_s=600, raise_on_failure=False))
    finally:
        await nc.close()
    assert b_rec.state == JobState.FAILED and "attempts" in b_rec.reason, b_rec
    assert "of env 'evil'" in b_rec.reason, b_rec.reason
    failed = [t.error for t in await trajectories(world, bob.id)]
    for why in ("`observation`: 300000 characters is over the limit", "`reward`: nan is not a finite number",
                "no reply on ot.env.user.bob.host.bob-evil.step", "unreadable EnvStepReply",
                f"no env host serves ot.env.user.bob.host.{alice_env}.step"):
        assert any(why in e for e in failed), (why, sorted(set(failed))[:10])
    assert not any(t.reward for t in await trajectories(world, bob.id))  # no flooded reply counted
    # the replies the rollout would not use are dead-lettered with the reason, naming the field
    whys = ("unreadable EnvStepReply", "`reward`: nan is not a finite number", "`observation`: 300000")
    letters = [d.reason for d in await dead_letters(
        world.service, "rollout", since, lambda got: all(any(w in d.reason for d in got) for w in whys))]
    for why in whys:
        assert any(why in r and "user 'bob'" in r for r in letters), (why, letters[:5])
    assert any("permissions violation" in e.lower() for e in errors), errors  # the flood, refused
    # alice's job, on her own env the whole time, completed every step
    assert a_rec.state == JobState.COMPLETED, (a_rec.reason, world.services.logs())
    TRAINED["alice"] = alice.id
    a_trajs = await trajectories(world, alice.id)
    assert {t.step for t in a_trajs if t.split == "train"} == {0, 1, 2}
    assert {t.env_info.get("served_by") for t in a_trajs} == {"alice"} and not any(t.error for t in a_trajs)
    assert all(code is None for code in world.alive().values()), (world.alive(), world.services.logs())


async def test_a_tenant_connection_sends_no_message_over_its_payload_limit(world):
    from opentinker.services.core.natsauth import TENANT_PAYLOAD_BYTES

    nc, errors = await user_connection(world.server.url, world.bob_key)
    assert nc.max_payload >= TENANT_PAYLOAD_BYTES
    try:
        await nc.publish("_R_.ABCDEF.xyz", b"x" * (TENANT_PAYLOAD_BYTES + 1))
        await nc.flush(timeout=5)
    except (nats.errors.Error, asyncio.TimeoutError):
        pass
    await asyncio.sleep(0.5)
    assert any("payload" in e.lower() or "permissions" in e.lower() for e in errors) or nc.is_closed, errors
    if not nc.is_closed:
        await nc.close()


async def test_alice_plays_her_trained_policy_on_her_own_env_with_only_her_key(world, alice_env, tmp_path):
    """`infer` as a user: the run's episodes travel in its SubmitJob (the scheduler asks
    the placed worker for them), the trajectories come back live and over REST."""
    assert "alice" in TRAINED, "needs the previous test's job"
    result = await world.alice.infer(env="mygame", job=TRAINED["alice"], episodes=4, group_size=2, seed=5,
                                     out_dir=tmp_path, timeout_s=300)
    assert len(result.trajectories) == 4 and not any(t.error for t in result.trajectories)
    assert {t.env_info.get("served_by") for t in result.trajectories} == {"alice"}
    assert {t.policy_version for t in result.trajectories} == {1}  # the trained policy, re-announced
    assert (tmp_path / "episodes.jsonl").read_text().count("\n") == 4
    rec = await world.alice.job(result.run_id).record()
    assert rec.state == JobState.COMPLETED and rec.env_owner == "alice" and rec.user == "alice"
    # the same seed gives the same problems, here to the base model (version 0)
    again = await world.alice.infer(env="mygame", episodes=4, group_size=2, seed=5, timeout_s=300)
    assert {t.policy_version for t in again.trajectories} == {0}

    def prompts(r):
        return sorted((t.group_index, tuple(t.token_ids[:t.prompt_len])) for t in r.trajectories)

    assert prompts(again) == prompts(result)
