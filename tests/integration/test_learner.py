"""The learner as a real subprocess on a real nats-server, with the test playing the
rollout side: it answers RolloutRequests with well-formed trajectories (token ids from
the tiny model's tokenizer, logprobs from the tiny model itself), and the scheduler's
part: a job record placing each job on the learner (`place_job`)."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import signal
import time

import msgspec
import pytest
import pytest_asyncio

from conftest import delete_consumers, place_job
import torch
from nats.js.api import DeliverPolicy
from nats.js.errors import ObjectNotFoundError
from safetensors.torch import load as load_safetensors

from opentinker.schemas import (
    DeadLetter, JobAssigned, JobSpec, JobState, JobStateChanged, Metrics, RolloutRequest, SamplingParams,
    Trajectory, TurnRecord, WeightsPublished, decode,
)
from opentinker.schemas import subjects as S
from opentinker.services.learner import checkpoint

TIMEOUT_S = 120


class FakeRollout:
    """Answers rollout requests the way the rollout service would, without sampling:
    a chat prompt, a short fixed answer, the tiny model's own logprobs."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def episode(self, req: RolloutRequest, k: int, policy_version: int) -> Trajectory:
        a, b = req.group_seed % 7, req.step + k
        text = self.tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                            tokenize=False, add_generation_prompt=True)
        prompt = self.tok(text, add_special_tokens=False)["input_ids"]
        answer = self.tok(str(a + b + k), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = prompt + answer
        with torch.no_grad():
            logp = torch.log_softmax(self.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        n = len(prompt)
        logprobs = [0.0] * n + [float(logp[t - 1, ids[t]]) for t in range(n, len(ids))]
        return Trajectory(
            job_id=req.job_id, request_id=req.request_id, episode_id=f"{req.request_id}-e{k}",
            policy_run=req.policy_run if policy_version > 0 else "",
            step=req.step, group_index=req.group_index, group_size=req.group_size, token_ids=ids,
            loss_mask=[0] * n + [1] * len(answer), logprobs=logprobs, prompt_len=n,
            turns=[TurnRecord(gen_start=n, gen_end=len(ids), obs_end=len(ids), reward=float(k == 0),
                              policy_version=policy_version)],
            reward=float(k == 0), policy_version=policy_version, env=req.env, created_s=time.time())


@pytest.fixture(autouse=True)
def remove_job_files(job_id, home):
    """The learner writes <home>/checkpoints/<job>/ (the final adapter); tests leave none."""
    yield
    for d in (home / "checkpoints").glob(f"{job_id}*"):
        shutil.rmtree(d, ignore_errors=True)


@pytest_asyncio.fixture(autouse=True)
async def play_the_rollout_side(bus):
    """These tests answer rollout requests themselves. A work-queue stream allows only
    non-overlapping consumers, so the rollout workers' shared consumer (left by other
    tests) goes before, and the per-job fake consumers go after."""
    await delete_consumers(bus, "OT_ROLLOUT")
    yield
    await delete_consumers(bus, "OT_ROLLOUT")


async def drain(bus, sub, kind, into: list) -> None:
    for m in await bus.fetch(sub, 32, 0.2):
        into.append(decode(m.data, kind))
        await m.ack()


async def answer_groups(bus, sub, fake, held: list | None = None, *, upto_step: int | None = None) -> None:
    """Answer each rollout request waiting on `sub` with a whole group from `fake`, at
    the request's policy version. With `upto_step`, a request for a later step is taken
    but not answered: it is kept in `held` for a later call with `held` alone to answer."""
    reqs = []
    for m in await bus.fetch(sub, 8, 0.2):
        reqs.append(decode(m.data, RolloutRequest))
        await m.ack()
    if held is not None and upto_step is None:
        reqs, held[:] = held + reqs, []
    for req in reqs:
        if upto_step is not None and req.step > upto_step:
            held.append(req)
            continue
        for k in range(req.group_size):
            await bus.publish(S.job(req.job_id, "traj"), fake.episode(req, k, req.policy_version))


@pytest.mark.timeout(180)
async def test_learner_runs_a_job_end_to_end(bus, job_id, tiny_model, services):
    # strictly on-policy (max_staleness 0): the stale answer below must be refused
    spec = JobSpec(model=tiny_model, lora_rank=4, lora_alpha=8, steps=2, prompts_per_step=2,
                   group_size=2, micro_batch_size=2, checkpoint_every=1, lr=1e-2, max_staleness=0,
                   sampling=SamplingParams(max_new_tokens=8))
    rollout_sub = await bus.durable(S.Durable(S.STREAM_ROLLOUT, f"fake-rollout-{job_id}", S.rollout(job_id, "fake")))
    subs = {kind: await bus.durable(S.Durable(stream, f"watch-{job_id}-{kind.__name__}", S.job(job_id, fam)),
                                    deliver_policy=DeliverPolicy.ALL)
            for kind, stream, fam in ((Metrics, "OT_METRICS", "metrics"),
                                      (WeightsPublished, "OT_WEIGHTS", "weights"),
                                      (JobStateChanged, "OT_EVENTS", "events"))}
    bad_id = f"{job_id}-bad"
    bad_events = await bus.durable(S.Durable(S.STREAM_EVENTS, f"watch-{bad_id}", S.job(bad_id, "events")))
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("learner")),
                            deliver_policy=DeliverPolicy.NEW)
    fake = FakeRollout(tiny_model)
    services.start("learner", f"worker_id=l-{job_id}")
    # an undecodable assignment, assignments no record places here, and a job that
    # cannot load its model come first: the learner dead-letters the first three, fails
    # the last, and goes on to the real job
    await bus.js.publish(S.assign_learner(f"l-{job_id}"), b"\xc1 not msgpack")
    await bus.publish(S.assign_learner(f"l-{job_id}"), JobAssigned(job_id=f"{job_id}-unknown", spec=spec, attempt=1,
                                                                    rollout_workers=["fake"]))
    await place_job(bus, f"{job_id}-other", spec, learner="another-learner", rollout=["fake"])
    await bus.publish(S.assign_learner(f"l-{job_id}"), JobAssigned(job_id=f"{job_id}-other", spec=spec, attempt=1,
                                                                    rollout_workers=["fake"]))
    bad = msgspec.structs.replace(spec, model=str(services.home / "no-such-model"))
    await place_job(bus, bad_id, bad, learner=f"l-{job_id}", rollout=["fake"])
    await place_job(bus, job_id, spec, learner=f"l-{job_id}", rollout=["fake"])
    await bus.publish(S.assign_learner(f"l-{job_id}"), JobAssigned(job_id=bad_id, spec=bad, rollout_workers=["fake"],
                                                                    attempt=1))
    await bus.publish(S.assign_learner(f"l-{job_id}"), JobAssigned(job_id=job_id, spec=spec, rollout_workers=["fake"],
                                                                    attempt=1), msg_id=f"assign-{job_id}")

    requests: list[RolloutRequest] = []
    seen = {Metrics: [], WeightsPublished: [], JobStateChanged: []}
    sent_stale = False
    deadline = time.monotonic() + TIMEOUT_S
    while not any(e.state.terminal for e in seen[JobStateChanged]):
        assert time.monotonic() < deadline, f"job did not finish; learner log:\n{services.logs()}"
        for m in await bus.fetch(rollout_sub, 8, 0.2):
            req = decode(m.data, RolloutRequest)
            requests.append(req)
            version = req.policy_version
            if req.step == 1 and req.group_index == 0 and not sent_stale:
                # answer once with an older policy than asked: max_staleness 0 refuses it
                version, sent_stale = req.policy_version - 1, True
            for k in range(req.group_size):
                await bus.publish(S.job(job_id, "traj"), fake.episode(req, k, version))
            await m.ack()
        for kind, sub in subs.items():
            await drain(bus, sub, kind, seen[kind])
        await asyncio.sleep(0.1)

    failed: list[JobStateChanged] = []
    await drain(bus, bad_events, JobStateChanged, failed)
    assert failed[-1].state == JobState.FAILED and "no-such-model" in failed[-1].reason
    letters: list[DeadLetter] = []
    await drain(bus, dlq, DeadLetter, letters)
    assert any(d.subject == S.assign_learner(f"l-{job_id}") and "cannot decode JobAssigned" in d.reason
               for d in letters)
    assert any(f"no job '{job_id}-unknown'" in d.reason for d in letters), letters
    assert any(f"does not place attempt 1 on learner l-{job_id}" in d.reason for d in letters), letters

    states = [e.state for e in seen[JobStateChanged] if e.source == "learner"]
    assert states[0] == JobState.RUNNING and states[-1] == JobState.COMPLETED, services.logs()

    # requests: one group per prompt per step, deterministic seeds, the stale group asked again
    ids = sorted(r.request_id for r in requests)
    run = requests[0].policy_run
    assert run and all(r.policy_run == run and r.attempt == 1 for r in requests)
    assert ids == sorted([f"{job_id}-s0-g0-r{run}", f"{job_id}-s0-g1-r{run}", f"{job_id}-s1-g0-r{run}",
                          f"{job_id}-s1-g0-a1-r{run}", f"{job_id}-s1-g1-r{run}"])
    assert [r.policy_version for r in requests if r.step == 1] == [1, 1, 1]

    metrics = {m.step: m for m in seen[Metrics]}
    assert sorted(metrics) == [0, 1]
    m0, m1 = metrics[0].values, metrics[1].values
    assert metrics[1].policy_version == 2
    # step 0 trains the very policy that "sampled": its logprobs match the sampler's
    assert m0["clip_frac"] == 0.0 and m0["approx_kl"] < 1e-4
    assert m0["reward_mean"] == 0.5 and m0["grad_norm"] > 0
    assert m1["dropped_stale"] == 1 and m0["dropped_stale"] == 0
    assert all(k in m1 for k in ("loss", "entropy", "tokens_per_s", "policy_lag_max", "error_frac"))
    assert "kl" not in m1  # kl_coef 0: no reference, no KL to it

    weights = {w.policy_version: w for w in seen[WeightsPublished]}
    assert {1, 2} <= set(weights)
    tensors = {}
    for v in (1, 2):
        w = weights[v]
        assert w.kind == "lora" and w.lora_rank == 4 and w.uri == f"nats-os://{S.OBJ_WEIGHTS}/{job_id}/v{v}"
        data = await bus.get_object(S.OBJ_WEIGHTS, f"{job_id}/v{v}")
        assert hashlib.sha256(data).hexdigest() == w.sha256 and len(data) == w.size_bytes
        tensors[v] = load_safetensors(data)
    assert any("lora_B" in k for k in tensors[2])
    assert any(not torch.equal(tensors[1][k], tensors[2][k]) for k in tensors[2])

    ckpt = await bus.get_object(S.OBJ_CHECKPOINTS, f"{job_id}/latest")
    assert len(ckpt) > 0
    final = services.home / "checkpoints" / job_id / "final"
    assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()


@pytest.mark.timeout(180)
async def test_a_restarted_learner_resumes_from_the_checkpoint(bus, job_id, tiny_model, services):
    spec = JobSpec(model=tiny_model, lora_rank=4, lora_alpha=8, steps=3, prompts_per_step=2,
                   group_size=2, micro_batch_size=4, checkpoint_every=1, lr=1e-2,
                   sampling=SamplingParams(max_new_tokens=8))
    rollout_sub = await bus.durable(S.Durable(S.STREAM_ROLLOUT, f"fake-rollout-{job_id}", S.rollout(job_id, "fake")))
    weights_sub = await bus.durable(S.Durable(S.STREAM_WEIGHTS, f"watch-{job_id}-w", S.job(job_id, "weights")))
    metrics_sub = await bus.durable(S.Durable(S.STREAM_METRICS, f"watch-{job_id}-m", S.job(job_id, "metrics")))
    events_sub = await bus.durable(S.Durable(S.STREAM_EVENTS, f"watch-{job_id}-e", S.job(job_id, "events")))
    fake = FakeRollout(tiny_model)
    first = services.start("learner", f"worker_id=l-{job_id}")
    await place_job(bus, job_id, spec, learner=f"l-{job_id}", rollout=["fake"])
    await bus.publish(S.assign_learner(f"l-{job_id}"), JobAssigned(job_id=job_id, spec=spec, rollout_workers=["fake"],
                                                                    attempt=1), msg_id=f"assign-{job_id}")

    pending: list[tuple[RolloutRequest, object]] = []
    metrics: list[Metrics] = []
    events: list[JobStateChanged] = []
    deadline = time.monotonic() + TIMEOUT_S

    async def poll(answer_steps: set[int]) -> None:
        assert time.monotonic() < deadline, f"timed out; logs:\n{services.logs()}"
        for m in await bus.fetch(rollout_sub, 8, 0.2):
            pending.append((decode(m.data, RolloutRequest), m))
        for req, m in [p for p in pending if p[0].step in answer_steps]:
            for k in range(req.group_size):
                await bus.publish(S.job(job_id, "traj"), fake.episode(req, k, req.policy_version))
            await m.ack()
            pending.remove((req, m))
        await drain(bus, metrics_sub, Metrics, metrics)
        await drain(bus, events_sub, JobStateChanged, events)
        await asyncio.sleep(0.1)

    # step 0 trains and checkpoints; the learner then waits for step 1
    while not (any(m.step == 0 for m in metrics) and any(r.step == 1 for r, _ in pending)):
        await poll({0})
    first.send_signal(signal.SIGTERM)
    await asyncio.to_thread(first.wait, 30)
    # step 1's trajectories arrive while no learner runs; a new learner must train on them
    await poll({1})
    services.start("learner", f"worker_id=l-{job_id}")
    while not any(e.state == JobState.COMPLETED for e in events):
        await poll({1, 2})

    assert sorted(m.step for m in metrics) == [0, 1, 2]
    assert not any(e.state == JobState.FAILED for e in events), services.logs()
    assert "resumed from step 0" in services.logs(tail=None)
    weights: list[WeightsPublished] = []
    await drain(bus, weights_sub, WeightsPublished, weights)
    v1 = [w for w in weights if w.policy_version == 1]
    # the resumed learner republishes the checkpointed version: the very same bytes
    assert len(v1) == 2 and v1[0].sha256 == v1[1].sha256
    assert sorted({w.policy_version for w in weights}) == [1, 2, 3]


async def test_checkpoints_travel_inline_when_small_and_by_pointer_when_large(bus, job_id, tmp_path,
                                                                             monkeypatch):
    state = tmp_path / "engine"
    (state / "state").mkdir(parents=True)
    (state / "state" / "mp_rank_00_model_states.pt").write_bytes(b"w" * 1000)
    meta = {"step": 3, "policy_version": 4, "traj_floor": 10, "traj_used": [12], "attempts": {4: [0, 1]},
            "rng": checkpoint.rng_state()}
    home = tmp_path / "home"
    await checkpoint.put(bus, job_id, checkpoint.store(home, job_id, meta, state))
    got, where = checkpoint.unpack(await checkpoint.get(bus, job_id), tmp_path / "restore")
    assert got["traj_used"] == [12] and got["attempts"] == {4: [0, 1]}
    assert (where / "state" / "mp_rank_00_model_states.pt").read_bytes() == b"w" * 1000

    monkeypatch.setattr(checkpoint, "SMALL_BYTES", 100)
    await checkpoint.put(bus, job_id, checkpoint.store(home, job_id, {**meta, "step": 5}, state))
    data = await checkpoint.get(bus, job_id)
    assert b"w" * 1000 not in data  # a pointer, not the weights
    got, where = checkpoint.unpack(data, tmp_path / "restore2")
    assert got["step"] == 5 and where == home / "checkpoints" / job_id / "step-5"
    assert (where / "state" / "mp_rank_00_model_states.pt").read_bytes() == b"w" * 1000
    assert await checkpoint.get(bus, f"{job_id}-none") is None


@pytest.mark.timeout(180)
async def test_a_cancelled_job_stops_and_the_learner_serves_the_next(bus, job_id, tiny_model, services):
    spec = JobSpec(model=tiny_model, lora_rank=4, lora_alpha=8, steps=5, prompts_per_step=1,
                   group_size=2, micro_batch_size=2, sampling=SamplingParams(max_new_tokens=8))
    next_id = f"{job_id}-next"
    rollout_subs = [await bus.durable(S.Durable(S.STREAM_ROLLOUT, f"fake-rollout-{j}", S.rollout(j, "fake")))
                    for j in (job_id, next_id)]
    events_subs = [await bus.durable(S.Durable(S.STREAM_EVENTS, f"watch-{j}-e", S.job(j, "events")))
                   for j in (job_id, next_id)]
    metrics_sub = await bus.durable(S.Durable(S.STREAM_METRICS, f"watch-{job_id}-m", S.job(job_id, "metrics")))
    fake = FakeRollout(tiny_model)
    services.start("learner", f"worker_id=l-{job_id}")
    await place_job(bus, job_id, spec, learner=f"l-{job_id}", rollout=["fake"])
    await place_job(bus, next_id, msgspec.structs.replace(spec, steps=1), learner=f"l-{job_id}", rollout=["fake"])
    await bus.publish(S.assign_learner(f"l-{job_id}"), JobAssigned(job_id=job_id, spec=spec, rollout_workers=["fake"],
                                                                    attempt=1))
    metrics: list[Metrics] = []
    events: list[JobStateChanged] = []
    deadline = time.monotonic() + TIMEOUT_S

    async def poll() -> None:
        assert time.monotonic() < deadline, f"timed out; logs:\n{services.logs()}"
        for sub in rollout_subs:
            for m in await bus.fetch(sub, 8, 0.1):
                req = decode(m.data, RolloutRequest)
                if req.job_id == next_id or req.step == 0:  # the cancelled job never gets step 1
                    for k in range(req.group_size):
                        await bus.publish(S.job(req.job_id, "traj"), fake.episode(req, k, req.policy_version))
                await m.ack()
        await drain(bus, metrics_sub, Metrics, metrics)
        for sub in events_subs:
            await drain(bus, sub, JobStateChanged, events)

    while not metrics:
        await poll()
    await bus.publish(S.job(job_id, "events"), JobStateChanged(
        job_id=job_id, state=JobState.CANCELLED, reason="by the test", source="scheduler"))
    # the learner hands the job back as done and takes the next one
    await bus.publish(S.assign_learner(f"l-{job_id}"),
                      JobAssigned(job_id=next_id, spec=msgspec.structs.replace(spec, steps=1),
                                  rollout_workers=["fake"], attempt=1))
    while not any(e.job_id == next_id and e.state == JobState.COMPLETED for e in events):
        await poll()

    mine = [e for e in events if e.job_id == job_id and e.source == "learner"]
    assert all(e.state == JobState.RUNNING for e in mine), services.logs()
    assert [m.step for m in metrics] == [0]
    # both assignments are acknowledged (done), none handed back for redelivery
    while (info := await bus.js.consumer_info("OT_CTL", f"learner-l-{job_id}")).num_ack_pending:
        await poll()
    assert info.num_pending == 0 and info.num_redelivered == 0


def failed_episode(req: RolloutRequest, k: int, error: str) -> Trajectory:
    """What rollout publishes for an episode its environment or engine failed."""
    return Trajectory(job_id=req.job_id, request_id=req.request_id, episode_id=f"{req.request_id}-e{k}",
                      step=req.step, group_index=req.group_index, group_size=req.group_size, token_ids=[],
                      loss_mask=[], logprobs=[], prompt_len=0, turns=[], reward=0.0, policy_version=0,
                      error=error)


@pytest.mark.timeout(300)
async def test_groups_that_fail_or_never_come_are_asked_again_then_fail_the_job_naming_why(
        bus, job_id, tiny_model, services):
    """Before: a group whose request rollout had dead-lettered (a model it cannot load,
    weights it cannot apply) left the learner waiting forever, and a group of failed
    episodes was trained as the policy's failures."""
    spec = JobSpec(model=tiny_model, lora_rank=4, lora_alpha=8, steps=2, prompts_per_step=1, group_size=2,
                   micro_batch_size=2, sampling=SamplingParams(max_new_tokens=8), rollout_timeout_s=1.5)
    erroring, silent = f"{job_id}-err", f"{job_id}-silent"
    subs = {j: await bus.durable(S.Durable(S.STREAM_ROLLOUT, f"fake-rollout-{j}", S.rollout(j, "fake")))
            for j in (erroring, silent)}
    events = {j: await bus.durable(S.Durable(S.STREAM_EVENTS, f"watch-{j}", S.job(j, "events")))
              for j in (erroring, silent)}
    services.start("learner", f"worker_id=l-{job_id}")
    for j in (erroring, silent):
        await place_job(bus, j, spec, learner=f"l-{job_id}", rollout=["fake"])
        await bus.publish(S.assign_learner(f"l-{job_id}"), JobAssigned(job_id=j, spec=spec, rollout_workers=["fake"],
                                                                        attempt=1))
    asked: dict[str, list[RolloutRequest]] = {erroring: [], silent: []}
    seen: dict[str, list[JobStateChanged]] = {erroring: [], silent: []}
    deadline = time.monotonic() + 240
    while not all(any(e.state.terminal for e in seen[j]) for j in seen):
        assert time.monotonic() < deadline, services.logs()
        for j, sub in subs.items():
            for m in await bus.fetch(sub, 8, 0.2):
                req = decode(m.data, RolloutRequest)
                asked[j].append(req)
                if j == erroring:  # every episode fails in the environment; the silent job's never come
                    for k in range(req.group_size):
                        await bus.publish(S.job(j, "traj"), failed_episode(req, k, "EnvError: env reset: no env "
                                                                                  "host serves ot.env.arith.reset"))
                await m.ack()
        for j, sub in events.items():
            await drain(bus, sub, JobStateChanged, seen[j])
    for j, why in ((erroring, "every episode failed: EnvError: env reset: no env host serves"),
                   (silent, "timeout: 0 of 2 episodes")):
        last = seen[j][-1]
        assert last.state == JobState.FAILED and "8 attempts" in last.reason and why in last.reason, last
        # step 0's one group, asked 8 times (and step 1's once, ahead: max_staleness 1),
        # then nothing: no step was trained on failures
        assert sorted(r.step for r in asked[j]) == [0] * 8 + [1], [r.request_id for r in asked[j]]
        assert len({r.request_id for r in asked[j]}) == 9


@pytest.mark.timeout(300)
async def test_a_learner_that_missed_its_requeue_stops_before_overwriting_the_next_attempt(
        bus, job_id, tiny_model, services):
    """Before: a learner that did not see the scheduler's requeue event kept training,
    publishing weights and overwriting the checkpoint the job's next attempt resumes from."""
    spec = JobSpec(model=tiny_model, lora_rank=4, lora_alpha=8, steps=6, prompts_per_step=1, group_size=2,
                   micro_batch_size=2, checkpoint_every=1, sampling=SamplingParams(max_new_tokens=8))
    rollout_sub = await bus.durable(S.Durable(S.STREAM_ROLLOUT, f"fake-rollout-{job_id}", S.rollout(job_id, "fake")))
    weights_sub = await bus.durable(S.Durable(S.STREAM_WEIGHTS, f"watch-{job_id}-w", S.job(job_id, "weights")))
    fake = FakeRollout(tiny_model)
    services.start("learner", f"worker_id=l-{job_id}")
    await place_job(bus, job_id, spec, learner=f"l-{job_id}", rollout=["fake"])
    await bus.publish(S.assign_learner(f"l-{job_id}"), JobAssigned(job_id=job_id, spec=spec, rollout_workers=["fake"],
                                                                    attempt=1))
    weights: list[WeightsPublished] = []
    held: list = []  # step 1's request (asked ahead, max_staleness 1) waits for the requeue,
    # so the learner cannot have passed its next fence before the job is placed elsewhere
    deadline = time.monotonic() + 200
    while not weights:
        assert time.monotonic() < deadline, services.logs()
        await answer_groups(bus, rollout_sub, fake, held, upto_step=0)
        await drain(bus, weights_sub, WeightsPublished, weights)
    ckpt = None
    while ckpt is None:  # the step's checkpoint follows its weight event
        assert time.monotonic() < deadline, services.logs()
        try:
            ckpt = await bus.get_object(S.OBJ_CHECKPOINTS, f"{job_id}/latest")
        except ObjectNotFoundError:
            await asyncio.sleep(0.2)
    # the scheduler requeues the job and places it elsewhere (attempt 2); this learner
    # never hears of it (no event), but keeps being answered
    await place_job(bus, job_id, spec, learner="another-learner", rollout=["fake"], attempt=2)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 15:
        await answer_groups(bus, rollout_sub, fake, held)
        await drain(bus, weights_sub, WeightsPublished, weights)
    assert not held
    assert [w.policy_version for w in weights] == [1], [w.policy_version for w in weights]
    assert await bus.get_object(S.OBJ_CHECKPOINTS, f"{job_id}/latest") == ckpt
    assert "attempt 1 is stale" in services.logs(tail=None) or "stops" in services.logs(tail=None), services.logs()
