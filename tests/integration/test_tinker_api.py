"""The official `tinker` SDK (pinned in the server extra), unchanged, against the stack's
Tinker API: scheduler, learner, a rollout worker and the tinker service on a real
nats-server, SmolLM2-135M-Instruct (the tiny model where learning does not matter). A
supervised loop whose loss falls; every loss function's `loss:sum` against a hand
computation from the logprobs the server returns; a save_state / load_state round
trip; an RL loop (sample, score, importance-sampling step) whose reward rises; prompt
logprobs and stop tokens; the REST client's listing of training runs and checkpoints;
wrong keys refused; another tenant's models, futures, saves, runs and checkpoints
unreachable; what is not served fails at once, naming itself; stable_reinforce on
samples recorded with record_stability_info (its value against its formula, forged and
foreign provenance refused); user metadata and ttl_seconds on runs and saves. Sessions
that end badly (a script that exits, a learner lost) are in test_tinker_sessions.py."""

import asyncio
import re
import time

import httpx
import numpy as np
import pytest

from opentinker.schemas import JobSpec, JobState, SubmitJob, SubmitReply
from opentinker.schemas import subjects as S

tinker = pytest.importorskip("tinker")

from conftest import Services  # noqa: E402
from tinker_sdk import datum, run_rest, run_sdk, start_stack, tenants  # noqa: E402


@pytest.fixture(scope="module")
async def tinker_stack(nats_url, home, tmp_path_factory):
    """The module's one stack (its tests run one after another on the one learner, each
    closing its sessions): the tinker service's base URL and the stack's Services."""
    services = Services(nats_url, home, tmp_path_factory.mktemp("tinker-stack"))
    try:
        yield await start_stack(services), services
    finally:
        services.stop_all()


@pytest.fixture
def services(tinker_stack):
    """The module stack's Services (its logs and home), in place of a test's own."""
    return tinker_stack[1]


@pytest.fixture
async def stack(tinker_stack, bus, job_id):
    """The module stack's base URL and two tenants of the test's own: (base URL, {who: key})."""
    return tinker_stack[0], await tenants(bus, job_id)


async def test_the_official_sdk_trains_saves_and_loads(stack, smollm2, bus, services, job_id):
    base, keys = stack
    t0 = time.time()

    def session(sc):
        tc = sc.create_lora_training_client(base_model=smollm2, rank=4, seed=0).result()
        tok = tc.get_tokenizer()  # the model's own folder: no hub
        info = tc.get_info()
        assert info.model_data.model_name == smollm2 and tok.vocab_size > 0
        ids = tok.encode("The quick brown fox jumps over the lazy dog.")[:12]
        sl = [datum(ids, weights=[0.0] * 3 + [1.0] * (len(ids) - 4))]
        losses, out = [], None
        for _ in range(8):
            fb = tc.forward_backward(sl, "cross_entropy")
            opt = tc.optim_step(tinker.AdamParams(learning_rate=1e-3))
            out = fb.result()
            opt.result()
            losses.append(out.metrics["loss:sum"])
        # cross_entropy is sum(-lp * w), from the per-token logprobs returned
        lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
        w = sl[0].loss_fn_inputs["weights"].to_numpy()
        assert lp.shape == (len(ids) - 1,) and out.metrics["loss:sum"] == pytest.approx(-(lp * w).sum(), rel=1e-4)

        # every loss against its formula, on the logprobs the forward pass returns
        q = lp - 0.3 * np.sin(np.arange(len(lp)))  # a sampler's logprobs, off by a little
        adv = np.where(np.arange(len(lp)) % 2 == 0, 1.5, -0.5).astype(np.float32)
        rl = [datum(ids, logprobs=q, advantages=adv)]
        got = {}
        for loss, cfg in (("importance_sampling", None), ("ppo", None), ("gspo", None), ("cispo", None),
                          ("dro", {"beta": 0.1})):
            r = tc.forward(rl, loss, loss_fn_config=cfg).result()
            got[loss] = (r.metrics["loss:sum"], r.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64))
        now = got["importance_sampling"][1]
        ratio = np.exp(now - q)
        assert got["importance_sampling"][0] == pytest.approx(-(ratio * adv).sum(), rel=1e-4)
        assert got["ppo"][0] == pytest.approx(-np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv).sum(), rel=1e-4)
        s = np.exp((now - q).mean())  # GSPO's sequence ratio (every token has A != 0 here)
        assert got["gspo"][0] == pytest.approx(-np.minimum(s * adv, np.clip(s, 1 - 3e-4, 1 + 4e-4) * adv).sum(),
                                               rel=1e-4)
        assert got["cispo"][0] == pytest.approx(-(np.clip(ratio, 0.0, 4.0) * now * adv).sum(), rel=1e-4)
        assert got["dro"][0] == pytest.approx(-(now * adv - 0.05 * (now - q) ** 2).sum(), rel=1e-4)

        # a bad request fails its own future, naming the fault; the session goes on
        with pytest.raises(tinker.RequestFailedError, match="needs provenance"):
            tc.forward(rl, "stable_reinforce").result()
        with pytest.raises(tinker.RequestFailedError, match="beta"):
            tc.forward(rl, "dro").result()

        # forward_backward_custom: the SDK differentiates the user's loss on the logprobs of
        # a forward pass and sends -dL/dlogprobs as cross_entropy weights
        def custom(data, logprobs_list):
            import torch

            loss = sum((-lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum()
                       for d, lp in zip(data, logprobs_list))
            return loss, {"custom:sum": float(loss)}

        ce = tc.forward(sl, "cross_entropy").result().metrics["loss:sum"]
        cust = tc.forward_backward_custom(sl, custom).result()
        assert cust.metrics["loss:sum"] == pytest.approx(ce, rel=1e-4)
        assert cust.metrics["surrogate_loss:sum"] == pytest.approx(ce, rel=1e-4)

        # save_state / load_state: the saved weights and optimizer come back
        path = tc.save_state("ckpt-a").result().path
        before = tc.forward(sl, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        for _ in range(2):
            tc.forward_backward(sl, "cross_entropy")
            tc.optim_step(tinker.AdamParams(learning_rate=2e-2)).result()
        moved = tc.forward(sl, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        tc.load_state_with_optimizer(path).result()
        back = tc.forward(sl, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        spath = tc.save_weights_for_sampler("smp-a").result().path
        return losses, path, before, moved, back, tc.model_id, sl, spath

    losses, path, before, moved, back, mid, sl, spath = await asyncio.to_thread(run_sdk, base, keys["alice"],
                                                                                session)
    print(f"SFT loss by step: {[round(x, 3) for x in losses]}")
    assert losses[-1] < 0.5 * losses[0], losses
    assert path == f"tinker://{mid}/weights/ckpt-a"
    assert np.abs(moved - before).max() > 1e-3 and np.allclose(back, before, atol=1e-5)
    # the client closed its session: the learner exported the policy and completed
    job = mid.replace(":train:", "-m")
    for _ in range(300):
        rec, _ = await bus.job_record(job)
        if rec.state.terminal:
            break
        await asyncio.sleep(0.2)
    assert rec.state == JobState.COMPLETED, (rec, services.logs())
    assert (services.home / "checkpoints" / job / "final" / "adapter_config.json").exists()

    # later, a new session resumes from the save (the SDK's preferred way; the first
    # session's learner is free again: a training client holds a learner for its life)
    def resume(sc):
        tc = sc.create_training_client_from_state_with_optimizer(path).result()
        return tc.model_id, tc.forward(sl, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    mid2, resumed = await asyncio.to_thread(run_sdk, base, keys["alice"], resume)
    assert np.allclose(resumed, before, atol=1e-5)

    # the REST client: alice's training runs (newest first) and the checkpoints they saved
    def listing(rc):
        runs = rc.list_training_runs().result()
        second = rc.list_training_runs(limit=1, offset=1).result()
        run = rc.get_training_run(mid).result()
        by_path = rc.get_training_run_by_tinker_path(spath).result()
        ckpts = rc.list_checkpoints(mid).result()
        everything = rc.list_user_checkpoints().result()
        info = rc.get_weights_info_by_tinker_path(path).result()
        rc.delete_checkpoint_from_tinker_path(spath).result()
        after = rc.list_checkpoints(mid).result()
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            rc.delete_checkpoint(mid, "sampler_weights/smp-a").result()
        return runs, second, run, by_path, ckpts, everything, info, after

    runs, second, run, by_path, ckpts, everything, info, after = await asyncio.to_thread(
        run_rest, base, keys["alice"], listing)
    assert [r.training_run_id for r in runs.training_runs] == [mid2, mid]
    assert (runs.cursor.offset, runs.cursor.limit, runs.cursor.total_count) == (0, 20, 2)
    assert [r.training_run_id for r in second.training_runs] == [mid] and second.cursor.total_count == 2
    assert run == by_path and run.training_run_id == mid and run.base_model == smollm2
    assert run.model_owner == f"alice-{job_id[-6:]}" and run.is_lora and run.lora_rank == 4
    assert run.last_checkpoint.tinker_path == path and run.last_checkpoint.checkpoint_type == "training"
    assert run.last_sampler_checkpoint.tinker_path == spath
    assert t0 <= run.last_request_time.timestamp() <= time.time()
    assert {(c.checkpoint_type, c.checkpoint_id, c.tinker_path) for c in ckpts.checkpoints} == {
        ("training", "weights/ckpt-a", path), ("sampler", "sampler_weights/smp-a", spath)}
    assert all(t0 <= c.time.timestamp() <= time.time() and c.size_bytes > 0 for c in ckpts.checkpoints)
    assert [c.tinker_path for c in ckpts.checkpoints] == [spath, path]  # newest first
    # every run's: the resumed run saved nothing
    assert [c.tinker_path for c in everything.checkpoints] == [spath, path] and everything.cursor.total_count == 2
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_attn, info.train_mlp) == (
        smollm2, True, 4, True, True)
    assert [c.tinker_path for c in after.checkpoints] == [path]


async def test_keys_and_tenants(stack, tiny_model, bus, services, job_id):
    base, keys = stack

    def wrong_key(sc):
        return sc.create_lora_training_client(base_model=tiny_model, rank=4).result()

    with pytest.raises(tinker.AuthenticationError, match="invalid API key"):
        await asyncio.to_thread(run_sdk, base, "tml-otk-" + "x" * 43, wrong_key)

    def alice(sc):
        tc = sc.create_lora_training_client(base_model=tiny_model, rank=4).result()
        path = tc.save_state("mine").result().path
        tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        return tc.model_id, path

    mid, path = await asyncio.to_thread(run_sdk, base, keys["alice"], alice)
    rid = mid.replace(":train:", "-m") + ".1"  # the future of alice's save_state (seq_id 1)
    bob = {"X-API-Key": keys["bob"]}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        # another tenant's model, future and session: as if they did not exist
        r = await http.post("/api/v1/get_info", json={"model_id": mid}, headers=bob)
        assert r.status_code == 404 and "no model" in r.json()["detail"]
        r = await http.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=bob)
        assert r.status_code == 404
        r = await http.post("/api/v1/optim_step", headers=bob, json={
            "model_id": mid, "seq_id": 99, "adam_params": {"learning_rate": 1.0}})
        assert r.status_code == 404
        r = await http.post("/api/v1/session_heartbeat", json={"session_id": mid.split(":")[0]}, headers=bob)
        assert r.status_code == 404
        # no key, a key without the SDK's prefix, garbage bodies
        assert (await http.post("/api/v1/create_session", json={})).status_code == 401
        r = await http.post("/api/v1/forward_backward", content=b"\x08\xff\xff", headers=bob)
        assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["detail"]
        r = await http.post("/api/v1/get_info", content=b"{", headers=bob)
        assert r.status_code == 400
        # what sampling does not serve, or not that much of, is refused naming it (a
        # field the API did not know was ignored: the answer lacked what was asked)
        sample = {"sampling_session_id": "x", "seq_id": 0, "sampling_params": {"max_tokens": 16},
                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}
        for extra, field in (({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [1, 1]}},
                              "target_prompt_logprobs"), ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
                             ({"topk_sample_logprobs": 21}, "topk_sample_logprobs"),
                             ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
                             ({"topk_sample_logprobs": 20, "num_samples": 256, "sampling_params": {"max_tokens": 64}},
                              "topk_sample_logprobs")):
            r = await http.post("/api/v1/asample", json={**sample, **extra}, headers=bob)
            assert r.status_code == 400 and r.json()["detail"].startswith(f"{field}:"), (extra, r.text)

    def dimuon(sc):
        return sc.create_lora_training_client(base_model=tiny_model, rank=4,
                                              optimizer=tinker.types.DimuonOptimizerConfig()).result()

    # another optimizer than AdamW is refused when the model is made (it was ignored)
    with pytest.raises(tinker.BadRequestError, match="optimizer_config: only AdamW"):
        await asyncio.to_thread(run_sdk, base, keys["bob"], dimuon)

    def bob_loads_alices_save(sc):
        with pytest.raises(tinker.NotFoundError, match="no model"):
            sc.create_training_client_from_state(path).result()
        tc = sc.create_lora_training_client(base_model=tiny_model, rank=4).result()
        with pytest.raises(tinker.RequestFailedError, match="no model"):
            tc.load_state(path).result()
        with pytest.raises(tinker.RequestFailedError, match="must match"):
            tc.save_state("../escape").result()
        return tc.save_state("still-fine").result().path

    assert (await asyncio.to_thread(run_sdk, base, keys["bob"], bob_loads_alices_save)).endswith("/weights/still-fine")

    # the REST client: bob lists his own run and save only; alice's run, its checkpoints
    # and their weights info answer 404, to read and to delete, and her save stays
    def bob_lists(rc):
        runs, ckpts = rc.list_training_runs().result(), rc.list_user_checkpoints().result()
        for call in (lambda: rc.get_training_run(mid), lambda: rc.list_checkpoints(mid),
                     lambda: rc.delete_checkpoint(mid, "weights/mine"),
                     lambda: rc.delete_checkpoint_from_tinker_path(path),
                     lambda: rc.get_weights_info_by_tinker_path(path)):
            with pytest.raises(tinker.NotFoundError, match="no training run"):
                call().result()
        return runs, ckpts

    runs, ckpts = await asyncio.to_thread(run_rest, base, keys["bob"], bob_lists)
    assert [r.model_owner for r in runs.training_runs] == [f"bob-{job_id[-6:]}"] and runs.cursor.total_count == 1
    assert [c.checkpoint_id for c in ckpts.checkpoints] == ["weights/still-fine"]
    alices = await asyncio.to_thread(run_rest, base, keys["alice"], lambda rc: rc.list_checkpoints(mid).result())
    assert [c.tinker_path for c in alices.checkpoints] == [path]
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        # pages are bounded and counted from 0; a bad one names its field; ids are checked
        for query, field in (("limit=0", "limit"), ("limit=100001", "limit"), ("limit=x", "limit"),
                             ("offset=-1", "offset"), ("access_scope=everyone", "access_scope"),
                             ("project_id=p1", "project_id")):
            r = await http.get(f"/api/v1/training_runs?{query}", headers=bob)
            assert r.status_code == 400 and r.json()["detail"].startswith(f"{field}:"), (query, r.text)
        r = await http.get("/api/v1/checkpoints?offset=-5", headers=bob)
        assert r.status_code == 400 and r.json()["detail"].startswith("offset:")
        assert (await http.get("/api/v1/training_runs")).status_code == 401
        assert (await http.get("/api/v1/checkpoints")).status_code == 401
        for bad in ("/api/v1/training_runs/x", "/api/v1/training_runs/ts-0123456789:train:99",
                    f"/api/v1/training_runs/{mid}x/checkpoints"):
            r = await http.get(bad, headers=bob)
            assert r.status_code == 404 and "no training run" in r.json()["detail"], (bad, r.text)
        r = await http.delete(f"/api/v1/training_runs/{mid}/checkpoints/weights/..%2Fmine", headers={
            "X-API-Key": keys["alice"]})
        assert r.status_code == 404, r.text
    # nor by submitting a tinker job naming alice's save directly
    alices_job = mid.replace(":train:", "-m")
    reply = await bus.request(S.SUBMIT, SubmitJob(spec=JobSpec(algorithm="tinker", model=tiny_model,
                                                               tinker_init=f"{alices_job}/mine"),
                                                  api_key=keys["bob"].removeprefix("tml-")), SubmitReply)
    assert not reply.ok and reply.field == "tinker_init", reply
    # nor by seating alice's policy as the opponent of a self-play job
    reply = await bus.request(S.SUBMIT, SubmitJob(spec=JobSpec(model=tiny_model, env="gomoku-duel", agents=2,
                                                               opponents={"white": alices_job}),
                                                  api_key=keys["bob"].removeprefix("tml-")), SubmitReply)
    assert not reply.ok and reply.field == "opponents" and f"no job {alices_job!r} of yours" in reply.error, reply
    # nor by starting a job from alice's policy
    reply = await bus.request(S.SUBMIT, SubmitJob(spec=JobSpec(model=tiny_model, init_from=alices_job),
                                                  api_key=keys["bob"].removeprefix("tml-")), SubmitReply)
    assert not reply.ok and reply.field == "init_from" and f"no job {alices_job!r} of yours" in reply.error, reply
    # nor by having alice's policy teach his (on-policy distillation)
    reply = await bus.request(S.SUBMIT, SubmitJob(spec=JobSpec(model=tiny_model, teacher="job", teacher_job=alices_job,
                                                               distill_coef=1.0),
                                                  api_key=keys["bob"].removeprefix("tml-")), SubmitReply)
    assert not reply.ok and reply.field == "teacher_job" and f"no job {alices_job!r} of yours" in reply.error, reply


def rl_datum(prompt: list[int], seq, advantage: float) -> "tinker.Datum":
    """An RL datum as tinker-cookbook builds one: the prompt and the completion, the
    sampler's logprobs and the advantage on the completion's tokens only."""
    full = prompt + list(seq.tokens)
    zeros = [0.0] * (len(prompt) - 1)
    return datum(full, logprobs=zeros + list(seq.logprobs), advantages=zeros + [advantage] * len(seq.tokens))


async def test_rl_loop_samples_scores_and_trains(stack, smollm2, bus, services):
    """sample -> score -> importance_sampling step, through a sampling client on the
    newest weights each iteration (save_weights_and_get_sampling_client), on
    SmolLM2-135M-Instruct. The task: answer a yes-or-no question, reward 1 for a reply
    that starts with "Yes" (the base model's about one in three)."""
    base, keys = stack

    def loop(sc):
        tc = sc.create_lora_training_client(base_model=smollm2, rank=8, seed=0).result()
        tok = tc.get_tokenizer()
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Answer yes or no: is water wet?"}],
                                                    add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
        params = tinker.SamplingParams(max_tokens=3, temperature=1.0)
        rewards = []
        for _ in range(8):
            sampler = tc.save_weights_and_get_sampling_client().result()
            res = sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=16, sampling_params=params).result()
            texts = [tok.decode(s.tokens).strip() for s in res.sequences]
            r = np.array([float(t.lower().startswith("yes")) for t in texts])
            rewards.append(float(r.mean()))
            if r.std() > 0:
                data = [rl_datum(prompt, s, float(a)) for s, a in zip(res.sequences, r - r.mean())]
                tc.forward_backward(data, "importance_sampling")
            tc.optim_step(tinker.AdamParams(learning_rate=2e-3)).result()
        # prompt logprobs and a stop token, on the base model through create_sampling_client
        base_sampler = sc.create_sampling_client(base_model=smollm2).result()
        # a token id outside the vocabulary fails that call, naming it, and not the worker
        # (before: the worker exited, crash-looped on the redelivery, and the SDK waited)
        try:
            base_sampler.sample(tinker.ModelInput.from_ints([len(tok) + 10_000]), num_samples=1,
                                sampling_params=params).result()
            oov = "accepted"
        except Exception as e:  # the SDK's own error type for a failed request
            oov = str(e)
        # the base model's rate, on more samples than one iteration draws
        base_res = base_sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=64,
                                       sampling_params=params).result()
        base_rate = float(np.mean([tok.decode(s.tokens).strip().lower().startswith("yes") for s in base_res.sequences]))
        eos = tok.eos_token_id
        one = base_sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=2, include_prompt_logprobs=True,
                                  sampling_params=tinker.SamplingParams(max_tokens=6, stop=[eos])).result()
        # top_k = 1 leaves one token per step: greedy, each sampled logprob 0 (the processed
        # distribution's); the top-k sample logprobs are the raw distribution's
        top1 = base_sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=4, topk_sample_logprobs=3,
                                   sampling_params=tinker.SamplingParams(max_tokens=4, temperature=1.0,
                                                                         top_k=1)).result()
        # an RL loop's burst of calls (each a future, none waited for before the next):
        # the rollout worker serves those it fetches together in one engine call
        burst = [base_sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params)
                 for _ in range(8)]
        burst = [f.result() for f in burst]
        assert all(len(r.sequences) == 2 and all(1 <= len(s.tokens) <= 3 for s in r.sequences) for r in burst)
        # sampling_params.seed: the same seeded call on the same weights, alone or in a
        # burst, returns the same completions; another seed others
        seeded = [base_sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=4,
                                      sampling_params=tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=s))
                  for s in (5, 6, 5)]
        seeded = [[list(x.tokens) for x in f.result().sequences] for f in seeded]
        again = base_sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=4,
                                    sampling_params=tinker.SamplingParams(max_tokens=6, temperature=1.0,
                                                                          seed=5)).result()
        assert seeded[0] == seeded[2] == [list(x.tokens) for x in again.sequences] != seeded[1], seeded
        # what the cookbook's on-policy distillation asks of a teacher: the logprobs of a sequence
        scored = base_sampler.compute_logprobs(tinker.ModelInput.from_ints(prompt)).result()
        suffix = base_sampler.compute_logprobs(tinker.ModelInput.from_ints(prompt), prompt_logprobs_last_n=3).result()
        # what the cookbook's self-distillation (distillation/sdft.py) asks: top-k prompt logprobs
        topk = base_sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=1, include_prompt_logprobs=True,
                                   topk_prompt_logprobs=3, sampling_params=tinker.SamplingParams(max_tokens=1)).result()
        scored = (scored, suffix, topk)
        return rewards, base_rate, one, len(prompt), oov, top1, scored

    rewards, base_rate, one, n_prompt, oov, top1, scored = await asyncio.to_thread(run_sdk, base, keys["alice"],
                                                                                 loop)
    assert "out of the model's vocabulary" in oov, oov
    together = [int(n) for n in re.findall(r"sampler \S+: (\d+) sample calls, \d+ sequences in one engine call",
                                           "".join(f.read_text() for f in services.log_dir.glob("rollout-*.log")))]
    assert together and max(together) >= 2, together
    print(f"base model: {base_rate:.3f} (64 samples); reward by iteration: {[round(x, 3) for x in rewards]}")
    # the last three iterations (48 samples) against the base model's rate (64 samples):
    # the first iterations are no baseline, one step at this learning rate moves the rate
    assert np.mean(rewards[-3:]) > base_rate + 0.3, (base_rate, rewards)
    assert len(one.sequences) == 2 and all(1 <= len(s.tokens) <= 6 for s in one.sequences)
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.tokens) for s in one.sequences)
    assert len(one.prompt_logprobs) == n_prompt and one.prompt_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in one.prompt_logprobs[1:])
    scored, suffix, topk = scored
    assert scored == pytest.approx(one.prompt_logprobs, abs=1e-4)
    assert topk.topk_prompt_logprobs[0] is None and len(topk.topk_prompt_logprobs) == n_prompt
    for row, lp in zip(topk.topk_prompt_logprobs[1:], scored[1:]):
        assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1] and row[0][1] >= lp - 1e-4
    assert all(x is None for x in suffix[:-3]) and suffix[-3:] == pytest.approx(scored[-3:], abs=1e-4)
    assert len({tuple(s.tokens) for s in top1.sequences}) == 1
    assert all(lp == pytest.approx(0.0, abs=1e-4) for s in top1.sequences for lp in s.logprobs)
    for s in top1.sequences:  # greedy: each sampled token is its position's most likely
        assert [row[0][0] for row in s.topk_logprobs] == s.tokens, (s.tokens, s.topk_logprobs)
        assert all(len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1] for row in s.topk_logprobs)
    assert one.sequences[0].topk_logprobs is None  # not asked


def provenance_datum(prompt: list[int], seq, advantage: float, sid: str | None = None) -> "tinker.Datum":
    """The cookbook's rl_loop datum for stable_reinforce: rl_datum with provenance naming
    the sampled sequence (its with_sampled_provenance)."""
    sid = sid or seq.sequence_id
    return rl_datum(prompt, seq, advantage).with_provenance(
        model_input=[tinker.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     tinker.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                        tinker.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens))])


async def test_stable_reinforce_trains_on_recorded_samples_and_refuses_forged_or_foreign_provenance(
        stack, tiny_model, bus, job_id):
    base, keys = stack

    def first(sc):
        tc = sc.create_lora_training_client(base_model=tiny_model, rank=4, seed=0,
                                            user_metadata={"recipe_name": "rl_loop", "renderer_name": "role_colon"}
                                            ).result()
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        prompt = list(range(100, 110))
        res = sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=4,
                             sampling_params=tinker.SamplingParams(max_tokens=5, temperature=1.0)).result()
        adv = [1.0, -1.0, 0.5, -0.5]
        data = [provenance_datum(prompt, s, a) for s, a in zip(res.sequences, adv)]
        out = tc.forward_backward(data, "stable_reinforce").result()
        tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        # forged: a sampled token that is not the one recorded; a datum without provenance
        forged = [provenance_datum(prompt, type(s)(stop_reason=s.stop_reason, sequence_id=s.sequence_id,
                                                   _tokens_list=[t + 1 for t in s.tokens],
                                                   _logprobs_list=s.logprobs), 1.0) for s in res.sequences[:1]]
        with pytest.raises(tinker.RequestFailedError, match=r"data\[0\]\.model_input_spans\[1\]: model_input\[10\]"):
            tc.forward_backward(forged, "stable_reinforce").result()
        with pytest.raises(tinker.RequestFailedError, match=r"data\[0\]: loss_fn 'stable_reinforce' needs provenance"):
            tc.forward_backward([rl_datum(prompt, res.sequences[0], 1.0)], "stable_reinforce").result()
        # a sequence sampled without record_stability_info is not recorded
        plain = tc.save_weights_and_get_sampling_client().result()
        unrecorded = plain.sample(tinker.ModelInput.from_ints(prompt), num_samples=1,
                                  sampling_params=tinker.SamplingParams(max_tokens=3)).result().sequences[0]
        with pytest.raises(tinker.RequestFailedError, match="is not a sequence id of this server"):
            tc.forward_backward([provenance_datum(prompt, unrecorded, 1.0)], "stable_reinforce").result()
        # a save's ttl_seconds and user_metadata: kept, listed; out of bounds: refused
        path = tc.save_state("short-lived", ttl_seconds=3600, user_metadata={"step": "1"}).result().path
        for ttl in (-1, 0, 59, 10**12):
            with pytest.raises(tinker.RequestFailedError, match="ttl_seconds"):
                tc.save_state("bad-ttl", ttl_seconds=ttl).result()
        with pytest.raises(tinker.RequestFailedError, match="user_metadata: 33 keys"):
            tc.save_state("bad-md", user_metadata={f"k{i}": "v" for i in range(33)}).result()
        with pytest.raises(tinker.RequestFailedError, match="user_metadata"):
            tc.save_state("bad-md", user_metadata={"k": "v" * 100_000}).result()
        # a save of a name the model has is refused, its metadata left as it was, unless
        # overwrite=True (it was replaced silently); two in flight: the second is refused
        with pytest.raises(tinker.RequestFailedError, match=r"overwrite=True"):
            tc.save_state("short-lived", user_metadata={"step": "2"}).result()
        assert tc.save_state("twice", user_metadata={"n": "1"}, overwrite=True).result().path.endswith("/twice")
        # (the refused second's metadata is not kept: the first's stays, listed below)
        first = tc.save_state("again", user_metadata={"n": "first"})
        second = tc.save_state("again", user_metadata={"n": "second"}, ttl_seconds=3600)
        assert first.result().path.endswith("/again")
        with pytest.raises(tinker.RequestFailedError, match=r"save named 'again'"):
            second.result()
        assert tc.save_state("twice", user_metadata={"n": "2"}, overwrite=True).result().path.endswith("/twice")
        return out, res, prompt, adv, tc.model_id, path

    out, res, prompt, adv, mid, path = await asyncio.to_thread(run_sdk, base, keys["alice"], first)
    session = mid.split(":")[0]
    ids = [s.sequence_id for s in res.sequences]
    assert len(set(ids)) == 4 and all(i.startswith(f"{session}.") and len(i.split(".")[1]) == 32 for i in ids)
    # the loss: -sum over sampled tokens of M sg(min(r, 2)) A lp, r against the recorded
    # sampler logprobs, M = 0 for a sequence whose geometric-mean ratio leaves [0.9, 1.1]
    expected = 0.0
    for s, a, o in zip(res.sequences, adv, out.loss_fn_outputs):
        lp = o["logprobs"].to_numpy()[len(prompt) - 1:].astype(np.float64)
        log_r = lp - np.asarray(s.logprobs)
        if 0.9 <= np.exp(log_r.mean()) <= 1.1:
            expected -= (np.minimum(np.exp(log_r), 2.0) * a * lp).sum()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert out.metrics["active_tokens:sum"] == sum(len(s.tokens) for s in res.sequences)
    # the session finished: its records are deleted
    for _ in range(50):
        if not await bus.kv_values(S.KV_TINKER_SEQS, f"{session}."):
            break
        await asyncio.sleep(0.2)
    assert not await bus.kv_values(S.KV_TINKER_SEQS, f"{session}.")

    def listing(rc):
        return rc.get_training_run(mid).result(), rc.list_checkpoints(mid).result()

    run, ckpts = await asyncio.to_thread(run_rest, base, keys["alice"], listing)
    assert run.user_metadata == {"recipe_name": "rl_loop", "renderer_name": "role_colon"}
    (ckpt,) = [c for c in ckpts.checkpoints if c.tinker_path == path]
    assert ckpt.user_metadata == {"step": "1"} and 3590 < ckpt.expires_at.timestamp() - time.time() <= 3600
    (twice,) = [c for c in ckpts.checkpoints if c.tinker_path.endswith("/weights/twice")]
    assert twice.user_metadata == {"n": "2"}  # overwritten, metadata and all
    (again,) = [c for c in ckpts.checkpoints if c.tinker_path.endswith("/weights/again")]
    assert again.user_metadata == {"n": "first"} and again.expires_at is None, again

    # a new session (a recipe resumed) names the old session's sequences: refused
    def second(sc):
        tc = sc.create_training_client_from_state(path).result()
        with pytest.raises(tinker.RequestFailedError, match=r"model_input_spans\[0\]: .*is not one of this session's"):
            tc.forward_backward([provenance_datum(prompt, res.sequences[0], 1.0)], "stable_reinforce").result()
        with pytest.raises(tinker.RequestFailedError, match=r"\['recorded_logprobs'\]: the server's own"):
            d = rl_datum(prompt, res.sequences[0], 1.0)
            tc.forward_backward([tinker.Datum(model_input=d.model_input, loss_fn_inputs={
                **d.loss_fn_inputs, "recorded_logprobs": np.zeros(d.model_input.length, np.float32)})],
                "importance_sampling").result()

    await asyncio.to_thread(run_sdk, base, keys["alice"], second)

    # an hour on, the save is past its ttl: deleted, with its metadata
    from opentinker.services.tinker.runs import Runs

    assert path in await Runs(bus).expire(now=time.time() + 3601)
    ckpts = await asyncio.to_thread(run_rest, base, keys["alice"], lambda rc: rc.list_checkpoints(mid).result())
    assert path not in [c.tinker_path for c in ckpts.checkpoints]


async def test_recorded_samples_are_bounded_per_session_oldest_first_and_deleted_with_it(bus):
    """records.py on a real bus: a session past tinker_recorded_sequences_per_session loses
    its oldest recorded samples (another session keeps its own), a second retrieval of a
    result records nothing twice, and a finished session's records are deleted."""
    import secrets

    from opentinker.schemas.tinker import SampledSequence, TinkerSampler, TinkerSamples
    from opentinker.services.core.config import Settings
    from opentinker.services.tinker.records import Records

    records = Records(bus, Settings(tinker_recorded_sequences_per_session=4))
    sessions = [f"ts-{secrets.token_hex(5)}" for _ in range(2)]
    seq = SampledSequence(tokens=[4, 5], logprobs=[-0.1, -0.2], stop_reason="stop")
    keys: dict[str, list[str]] = {s: [] for s in sessions}
    for i in range(3):
        for s in sessions[:1] if i else sessions:
            sampler = TinkerSampler(sampler_id=f"{s}-s0", session_id=s, user="u", base_model="m")
            key = await records.start(f"{s}-s0.{i + 1}", sampler, [1, 2, 3])
            assert await records.start(f"{s}-s0.{i + 1}", sampler, [1, 2, 3]) == key  # a resent sample
            samples = TinkerSamples(sampler=sampler.sampler_id, seq_id=i + 1, sequences=[seq, seq], record_key=key)
            await records.finish(samples, s)
            await records.finish(samples, s)  # the result read back twice
            keys[s].append(key)
    first, other = sessions
    # a result read for one session that echoes another session's record key records nothing
    foreign = await records.start(f"{other}-s0.50", TinkerSampler(sampler_id=f"{other}-s0", session_id=other,
                                                                 user="u", base_model="m"), [1])
    await records.finish(TinkerSamples(sampler=f"{first}-s0", seq_id=50, sequences=[seq], record_key=foreign), first)
    named = {f"{k}.{j}": (k, j) for ks in keys.values() for k in ks for j in range(2)}
    got, _ = await records.load({**named, f"{foreign}.0": (foreign, 0)})
    assert got[f"{foreign}.0"] is None
    # six sequences of the first session, at most four kept: its first sample went
    assert [got[f"{k}.0"] is not None for k in keys[first]] == [False, True, True]
    assert got[f"{keys[other][0]}.1"].tokens == [4, 5] and got[f"{keys[other][0]}.1"].prompt == [1, 2, 3]
    await records.drop_session(first)
    got, _ = await records.load(named)
    assert all(got[f"{k}.0"] is None for k in keys[first]) and got[f"{keys[other][0]}.0"] is not None
