"""The rollout service as a real subprocess against a real nats-server, with a small
multi-turn game served in-test on the env subjects (the real envhost is not needed).

Checks what a learner relies on: trajectories arrive per episode with exact masks,
their logprobs are the policy's (recomputed with transformers), a published LoRA
version is applied and recorded, finished jobs are skipped, bad requests are
dead-lettered, and a worker serves only the jobs the scheduler's record places on it,
with the record's model."""

from __future__ import annotations

import asyncio
import hashlib
import time

import msgspec
import nats
import pytest
import torch
from safetensors.torch import save

from opentinker.schemas import (
    DeadLetter,
    EnvCloseRequest,
    EnvInitReply,
    EnvInitRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvStepReply,
    EnvStepRequest,
    JobRecord,
    JobSpec,
    JobState,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    WeightsPublished,
    decode,
    encode,
)
from opentinker.schemas import subjects as S

GAME_TURNS = 2


async def serve_game(bus, env: str, host_id: str) -> list:
    """A two-turn counting game on the env subjects. Returns its subscriptions."""
    steps: dict[str, int] = {}

    async def init(req: EnvInitRequest, _):
        return EnvInitReply(state={"start": req.seed % 10})

    async def reset(req: EnvResetRequest, _):
        steps[req.episode_id] = 0
        return EnvResetReply(host_id=host_id, system_prompt="You count.",
                             user_message=f"Count on from {req.state['start']}.")

    async def step(req: EnvStepRequest, _):
        steps[req.episode_id] += 1
        n = steps[req.episode_id]
        return EnvStepReply(observation=f"Next after {n}?", reward=0.5, done=n >= GAME_TURNS, info={"n": n})

    async def close(req: EnvCloseRequest, _):
        return EnvStepReply()

    return [await bus.serve(S.env_init(env), EnvInitRequest, init, queue=S.env_queue_group(env)),
            await bus.serve(S.env_reset(env), EnvResetRequest, reset, queue=S.env_queue_group(env)),
            await bus.serve(S.env_step(host_id), EnvStepRequest, step),
            await bus.serve(S.env_close(host_id), EnvCloseRequest, close)]


def rollout_request(job_id: str, model: str, env: str, request_id: str, version: int) -> RolloutRequest:
    """A request of `job_id` with id `<job_id>-<request_id>` (placement attempt 1)."""
    return RolloutRequest(job_id=job_id, request_id=f"{job_id}-{request_id}", step=version, group_index=0,
                          attempt=1,
                          group_seed=3, policy_version=version, model=model, env=env, group_size=3,
                          sampling=SamplingParams(temperature=1.0, max_new_tokens=6, max_turns=3))


async def collect(bus, sub, n: int, services, timeout_s: float = 240.0) -> list[Trajectory]:
    got: dict[str, Trajectory] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        if time.monotonic() > deadline:
            pytest.fail(f"{len(got)}/{n} trajectories arrived\n{services.logs()}")
        for p in services.procs:
            if p[1].poll() is not None:
                pytest.fail(f"the rollout service exited\n{services.logs()}")
        for m in await bus.fetch(sub, 16, 1.0):
            t = decode(m.data, Trajectory)
            got[t.episode_id] = t
            await m.ack()
    return sorted(got.values(), key=lambda t: t.episode_id)


def policy_logprobs(model, t: Trajectory) -> torch.Tensor:
    """The model's logprob of every policy token of `t` (temperature 1, no top-p)."""
    ids = torch.tensor([t.token_ids])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    pos = [i for i, m in enumerate(t.loss_mask) if m]
    return torch.stack([logp[i - 1, t.token_ids[i]] for i in pos])


def check_masks(t: Trajectory, tokenizer) -> None:
    assert not t.error, t.error
    assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You count."}, {"role": "user", "content": "Count on from 3."}],
        add_generation_prompt=True, tokenize=False)
    assert t.token_ids[:t.prompt_len] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    policy = [i for turn in t.turns for i in range(turn.gen_start, turn.gen_end)]
    assert [i for i, m in enumerate(t.loss_mask) if m] == policy
    assert len(t.turns) == GAME_TURNS and t.reward == pytest.approx(0.5 * GAME_TURNS)
    first = t.turns[0]
    assert first.obs_end > first.gen_end and set(t.loss_mask[first.gen_end:first.obs_end]) == {0}
    assert tokenizer.decode(t.token_ids[first.gen_end:first.obs_end]).endswith(
        "<|im_start|>user\nNext after 1?<|im_end|>\n<|im_start|>assistant\n")


def lora_adapter(model_dir: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    """A peft LoRA (r 8, alpha 16, q/v) with a perturbed lora_B: its safetensors
    bytes and the merged model's state dict."""
    from conftest import make_lora

    sd, merged = make_lora(model_dir, r=8, alpha=16, std=1.0, seed=1)
    return save(sd), merged


async def run_rollout(engine: str, bus, services, job_id: str, tiny_model: str, tmp_path):
    """Versions 0 (base), 1 (LoRA), a second job (base again), 2 (full weights).
    Returns the version-2 model, the trajectory consumer, the env name and the game's
    subscriptions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import place_job

    env = f"count-{job_id}"
    await place_job(bus, job_id, JobSpec(model=tiny_model, env=env), rollout=[f"w-{job_id}"])
    await place_job(bus, f"{job_id}-b", JobSpec(model=tiny_model, env=env), rollout=[f"w-{job_id}"])
    subs = await serve_game(bus, env, host_id=f"h-{job_id}")
    traj_sub = await bus.durable(S.Durable(S.STREAM_TRAJ, f"traj-{job_id}", S.job(job_id, "traj")))
    # with vLLM, its multi-LoRA path (off by default on CPU, see bench/multi_lora.py)
    services.start("rollout", f"engine={engine}", f"worker_id=w-{job_id}",
                   *(["vllm_multi_lora=on"] if engine == "vllm" else []))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)

    # policy version 0: the base model
    await bus.publish(S.rollout(job_id, f"w-{job_id}"), rollout_request(job_id, tiny_model, env, "r0", 0))
    v0 = await collect(bus, traj_sub, 3, services)
    assert [t.episode_id for t in v0] == [f"{job_id}-r0-e{i}" for i in range(3)]
    for t in v0:
        check_masks(t, tok)
        assert t.policy_version == 0 and t.engine == engine and t.worker == f"w-{job_id}"
        assert torch.allclose(torch.tensor([t.logprobs[i] for i, m in enumerate(t.loss_mask) if m]),
                              policy_logprobs(base, t), atol=1e-4)

    # policy version 1: a LoRA adapter in the object store
    data, merged = lora_adapter(tiny_model)
    name = f"{job_id}/v1.safetensors"
    await bus.put_object(S.OBJ_WEIGHTS, name, data)
    ev = WeightsPublished(job_id=job_id, policy_version=1, kind="lora", uri=f"nats-os://{S.OBJ_WEIGHTS}/{name}",
                          sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), lora_rank=8,
                          lora_alpha=16, target_modules=["q_proj", "v_proj"], step=1)
    await bus.publish(S.job(job_id, "weights"), ev, msg_id=f"{job_id}-w1")
    await bus.publish(S.rollout(job_id, f"w-{job_id}"), rollout_request(job_id, tiny_model, env, "r1", 1))
    v1 = await collect(bus, traj_sub, 3, services)
    for t in v1:
        check_masks(t, tok)
        assert t.policy_version == 1 and [turn.policy_version for turn in t.turns] == [1, 1]
        sampled = torch.tensor([t.logprobs[i] for i, m in enumerate(t.loss_mask) if m])
        assert torch.allclose(sampled, policy_logprobs(merged, t), atol=1e-4)
        assert (sampled - policy_logprobs(base, t)).abs().max() > 1e-2  # not the base model

    # another job on the same model and worker: the engine goes back to the base weights
    other = f"{job_id}-b"
    other_sub = await bus.durable(S.Durable(S.STREAM_TRAJ, f"traj-{other}", S.job(other, "traj")))
    await bus.publish(S.rollout(other, f"w-{job_id}"), rollout_request(other, tiny_model, env, "r0", 0))
    for t in await collect(bus, other_sub, 3, services):
        check_masks(t, tok)
        assert torch.allclose(torch.tensor([t.logprobs[i] for i, m in enumerate(t.loss_mask) if m]),
                              policy_logprobs(base, t), atol=1e-4)

    # policy version 2: every parameter, from a file
    full = {k: v + 0.02 * torch.randn_like(v) for k, v in base.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "v2.safetensors"
    path.write_bytes(save(full))
    base.load_state_dict(full, strict=False)  # base is now policy version 2
    data = path.read_bytes()
    ev = WeightsPublished(job_id=job_id, policy_version=2, kind="full", uri=f"file://{path}",
                          sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), step=2)
    await bus.publish(S.job(job_id, "weights"), ev, msg_id=f"{job_id}-w2")
    await bus.publish(S.rollout(job_id, f"w-{job_id}"), rollout_request(job_id, tiny_model, env, "r2", 2))
    for t in await collect(bus, traj_sub, 3, services):
        check_masks(t, tok)
        assert t.policy_version == 2
        assert torch.allclose(torch.tensor([t.logprobs[i] for i, m in enumerate(t.loss_mask) if m]),
                              policy_logprobs(base, t), atol=1e-4)

    # an evaluation of version 1 asked before version 2 was published, served after:
    # pinned, its episodes are sampled by version 1; a training group asking for version
    # 2 in the same batch gets version 2 (one asking for 1 or older may share version 1)
    evaluation = msgspec.structs.replace(rollout_request(job_id, tiny_model, env, "eval-v1-e0", 1),
                                         purpose="eval", split="test")
    training = rollout_request(job_id, tiny_model, env, "r4", 2)
    await bus.publish(S.rollout(job_id, f"w-{job_id}"), evaluation)
    await bus.publish(S.rollout(job_id, f"w-{job_id}"), training)
    got = await collect(bus, traj_sub, 6, services)
    for t in got:
        check_masks(t, tok)
        sampled = torch.tensor([t.logprobs[i] for i, m in enumerate(t.loss_mask) if m])
        version, model = (1, merged) if t.purpose == "eval" else (2, base)
        assert [turn.policy_version for turn in t.turns] == [version, version], t.episode_id
        assert torch.allclose(sampled, policy_logprobs(model, t), atol=1e-4), t.episode_id
    assert sorted(t.purpose for t in got) == ["eval"] * 3 + ["train"] * 3
    return base, traj_sub, env, subs


async def test_rollout_service_hf(bus, services, job_id, tiny_model, tmp_path):
    policy, traj_sub, env, subs = await run_rollout("hf", bus, services, job_id, tiny_model, tmp_path)

    # a restarted worker knows the job's policy from the stream alone
    from conftest import place_job

    services.stop_all()
    await place_job(bus, job_id, JobSpec(model=tiny_model, env=env), rollout=[f"w2-{job_id}"])
    services.start("rollout", "engine=hf", f"worker_id=w2-{job_id}")
    await bus.publish(S.rollout(job_id, f"w2-{job_id}"), rollout_request(job_id, tiny_model, env, "r3", 2))
    for t in await collect(bus, traj_sub, 3, services):
        assert t.policy_version == 2 and t.worker == f"w2-{job_id}"
        assert torch.allclose(torch.tensor([t.logprobs[i] for i, m in enumerate(t.loss_mask) if m]),
                              policy_logprobs(policy, t), atol=1e-4)
    for s in subs:
        await s.unsubscribe()

    # a request of a finished job is acked and skipped; an unreadable one is dead-lettered
    done_job = f"{job_id}-done"
    kv = await bus.kv(S.KV_JOBS)
    await kv.put(done_job, encode(JobRecord(job_id=done_job, spec=JobSpec(), state=JobState.COMPLETED)))
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("rollout")),
                            deliver_policy=nats.js.api.DeliverPolicy.NEW)
    await bus.publish(S.rollout(done_job, f"w2-{job_id}"),
                      rollout_request(done_job, "smollm2-135m-instruct", "count", "rx", 0))
    await bus.js.publish(S.rollout(job_id, f"w2-{job_id}"), b"\xc1 not a request")
    bad = msgspec.structs.replace(rollout_request(job_id, "m", "count", "ry", 0), group_size=0)
    await bus.js.publish(S.rollout(job_id, f"w2-{job_id}"), encode(bad))
    # what the scheduler never placed here: another model than the job's (an engine a
    # job could load past placement and quotas), a job placed elsewhere, a job with no
    # record, a request id that is not the job's own
    await bus.publish(S.rollout(job_id, f"w2-{job_id}"), rollout_request(job_id, "gpt2", env, "rz", 0))
    elsewhere = f"{job_id}-far"
    await place_job(bus, elsewhere, JobSpec(model=tiny_model, env=env), rollout=["some-other-worker"])
    await bus.publish(S.rollout(elsewhere, f"w2-{job_id}"), rollout_request(elsewhere, tiny_model, env, "rw", 0))
    await bus.publish(S.rollout(f"{job_id}-none", f"w2-{job_id}"),
                      rollout_request(f"{job_id}-none", tiny_model, env, "rv", 0))
    await bus.publish(S.rollout(job_id, f"w2-{job_id}"), msgspec.structs.replace(
        rollout_request(job_id, tiny_model, env, "ru", 0), request_id="another-job-s0-g0"))
    await bus.publish(S.rollout(job_id, f"w2-{job_id}"), msgspec.structs.replace(
        rollout_request(job_id, tiny_model, env, "rt", 0), sampler_dtype="bfloat16"))
    # a teacher the scheduler never checked for the job's owner (a model path of anyone's)
    await bus.publish(S.rollout(job_id, f"w2-{job_id}"), msgspec.structs.replace(
        rollout_request(job_id, tiny_model, env, "rs", 0), teacher="model", teacher_model="/etc"))
    expected = ["cannot decode RolloutRequest", "`group_size`", "`model`: 'gpt2' is not job",
                "`sampler_dtype`: 'bfloat16' is not job", "`teacher`: 'model' is not job",
                f"job {elsewhere} is not placed on worker w2-{job_id}", f"no job '{job_id}-none'", "`request_id`"]
    letters: list[DeadLetter] = []
    deadline = time.monotonic() + 60
    while not all(any(e in d.reason for d in letters) for e in expected) and time.monotonic() < deadline:
        letters += [decode(m.data, DeadLetter) for m in await bus.fetch(dlq, 5, 1.0)]
    for e in expected:
        assert any(e in d.reason for d in letters), (e, [(d.subject, d.reason) for d in letters])
    for _ in range(30):  # acked requests leave the work queue
        try:
            await bus.js.get_last_msg("OT_ROLLOUT", S.rollout(done_job, f"w2-{job_id}"))
        except nats.js.errors.NotFoundError:
            break
        await asyncio.sleep(0.5)
    else:
        pytest.fail("the finished job's request was not acked")
    with pytest.raises(nats.js.errors.NotFoundError):
        await bus.js.get_last_msg("OT_TRAJ", S.job(done_job, "traj"))


async def test_rollout_service_vllm(bus, services, job_id, tiny_model, tmp_path):
    pytest.importorskip("vllm")
    *_, subs = await run_rollout("vllm", bus, services, job_id, tiny_model, tmp_path)
    for s in subs:
        await s.unsubscribe()
