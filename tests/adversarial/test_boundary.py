"""The tenant boundary, tried as a hostile tenant would: user B (bob), with an ordinary
API key, against user A (alice) on one shared stack: an authenticating nats-server
(services in account OT, API-key users in account TENANTS through the scheduler's
xkey-sealed auth callout) and every service as its own process, two learners and one
rollout worker in one pool.

Alice's training job runs while bob attacks. Each attack ends in a clear refusal (a
permissions violation from nats-server, a 4xx naming the field from the REST API, a
dead letter with the reason, a job FAILED with a reason that leaks nothing); at the end
alice's job has completed with every step reported once and its metrics exactly those
of its own trajectories, and no service has exited.

Attacks that need a service identity (a compromised or buggy service, since a user can
publish nothing) are tried with the service nkey: the services must still refuse them.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
import nats
import pytest

from opentinker.schemas import (
    CancelJob, JobState, JobStateChanged, RolloutRequest, SamplingParams,
    SubmitJob, JobSpec, encode,
)
from opentinker.schemas import subjects as S
from opentinker.services.core.logdb import run_query

from tenants import (ADMIN, ADMIN_KEY, A_STEPS, MAX_UNFINISHED, World, alice_trains, bearer, dead_letters,
                     user_connection)

pytestmark = pytest.mark.timeout(900)


async def bob_job_fails(w: World, spec: dict, timeout_s: float = 240) -> tuple[str, str]:
    """Submit `spec` as bob and wait for it to fail; returns (job id, the reason bob can
    read over REST)."""
    job = await w.bob.submit(spec)
    rec = await job.wait(timeout_s=timeout_s, raise_on_failure=False)
    assert rec.state == JobState.FAILED, (rec.state, rec.reason, w.services.logs())
    r = await w.api.get(f"/v1/jobs/{job.id}", headers=bearer(w.bob_key))
    assert r.status_code == 200
    return job.id, r.json()["reason"]


def sft(w: World, **kw) -> dict:
    return {"name": "bob-sft", "algorithm": "sft", "model": w.tiny_model, "steps": 1, "sft_batch_size": 2,
            "micro_batch_size": 2, "checkpoint_every": 100, **kw}


# -- the attacks (alice's job trains meanwhile) ---------------------------------------


async def test_a_tenant_can_publish_nothing_and_the_users_bucket_survives(world):
    """Tried for real: one CancelJob on ot.ctl.cancel with reply subject $KV.ot_users.zz
    made the scheduler write its reply into the users bucket, after which no job of any
    tenant could be placed."""
    nc, errors = await user_connection(world.server.url, world.bob_key)
    cancel = encode(CancelJob(job_id=world.a_job, api_key=world.bob_key))
    attempts = [
        (S.CANCEL, cancel, "$KV.ot_users.zz"),
        (S.SUBMIT, encode(SubmitJob(spec=JobSpec(), api_key=world.bob_key)), "$KV.ot_jobs.zz"),
        (S.job(world.a_job, "events"), encode(JobStateChanged(job_id=world.a_job, state=JobState.FAILED,
                                                              reason="pwned", source="scheduler")), None),
        (f"ot.job.{world.a_job}.rollout.adv-r1", b"x", None),
        (S.job(world.a_job, "traj"), b"x", None),
        ("$KV.ot_users.zz", b"garbage", None),
        ("$JS.API.STREAM.INFO.OT_METRICS", b"", None),
        ("ot.ctl.assign.learner.adv-l2", b"x", None),
        ("ot.env.arith.reset", b"x", None),
        ("$SYS.REQ.USER.AUTH", b"x", None),
    ]
    for subject, data, reply in attempts:
        await nc.publish(subject, data, reply=reply or "")
    await nc.flush()
    await asyncio.sleep(1.0)
    for subject, _, _ in attempts:
        assert any(f'publish to "{subject}"'.lower() in e.lower() for e in errors), (subject, errors)
    await nc.close()
    # the users bucket still holds only users, and placement still runs for everyone
    r = await world.api.get("/v1/users", headers=ADMIN)
    assert r.status_code == 200 and {u["name"] for u in r.json()} >= {"admin", "alice", "bob"}, r.text
    kv = await world.service.kv(S.KV_USERS)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("zz")
    rec = await world.alice.job(world.a_job).record()
    assert rec.state in (JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED), rec


async def test_a_tenant_subscribes_only_to_its_own_jobs(world):
    nc, errors = await user_connection(world.server.url, world.bob_key)
    got: list[str] = []

    async def took(m):
        got.append(m.subject)

    denied = (f"ot.job.{world.a_job}.>", f"ot.job.{world.a_job}.metrics", "ot.job.*.events", "ot.job.>",
              "_INBOX.>", "ot.ctl.>", "$KV.>", "$JS.API.>", ">")
    for subject in denied:
        await nc.subscribe(subject, cb=took)
    await nc.flush()
    await asyncio.sleep(2.0)  # alice's job publishes metrics and trajectories meanwhile
    for subject in denied:
        assert any(f'subscription to "{subject}"'.lower() in e.lower() for e in errors), (subject, errors)
    assert got == []
    await nc.close()
    # nor through the SDK or the REST API
    with pytest.raises(KeyError):
        await world.bob.job(world.a_job).record()
    r = await world.api.get(f"/v1/jobs/{world.a_job}/metrics", headers=bearer(world.bob_key))
    assert r.status_code == 404


async def test_services_answer_only_onto_an_inbox(world):
    """The scheduler publishes with service rights, so a reply subject chosen by the
    sender (even another service, buggy or compromised) must never be a stream or KV
    subject."""
    since = time.time()
    for subject, msg in ((S.CANCEL, CancelJob(job_id=world.a_job, api_key=ADMIN_KEY)),
                         (S.SUBMIT, SubmitJob(spec=JobSpec(steps=1), api_key=ADMIN_KEY))):
        await world.service.nc.publish(subject, encode(msg), reply="$KV.ot_users.zz2")
    letters = await dead_letters(world.service, "scheduler", since, lambda d: len(d) >= 2)
    assert sum("reply subject '$KV.ot_users.zz2' refused" in d.reason for d in letters) == 2, letters
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await (await world.service.kv(S.KV_USERS)).get("zz2")
    # alice's job was not cancelled by that request
    rec = await world.alice.job(world.a_job).record()
    assert rec.state != JobState.CANCELLED, rec


async def test_an_event_whose_body_names_another_job_is_dead_lettered(world):
    since = time.time()
    forged = JobStateChanged(job_id=world.a_job, state=JobState.FAILED, reason="forged", source="learner",
                             time_s=time.time())
    await world.service.publish(S.job("bob-own-job", "events"), forged)
    letters = await dead_letters(world.service, "scheduler", since,
                                 lambda d: any("JobStateChanged.job_id" in x.reason for x in d))
    assert any(f"JobStateChanged.job_id: '{world.a_job}' on ot.job.bob-own-job.events" in d.reason
               for d in letters), letters
    rec = await world.alice.job(world.a_job).record()
    assert rec.state != JobState.FAILED and "forged" not in rec.reason, rec


async def test_rollout_serves_only_what_the_scheduler_placed_on_it(world):
    """A request naming the victim's episode ids (request_id <victim>-s7-g0), another job
    not placed on the worker, or another model than the job's (an engine loaded past
    placement and quotas) is refused. The victim is alice's first job while it runs, else
    (this test run after others) a job of her own, started here and cancelled after."""
    since = time.time()
    job_id, own = world.a_job, None
    a_rec = await world.alice.job(job_id).record()
    if a_rec.state.terminal:
        own = await alice_trains(world, "boundary-placed", 200)
        job_id = own.job.id
        deadline = time.monotonic() + 120
        while not ((a_rec := await own.job.record()).state == JobState.RUNNING and a_rec.placement is not None
                   and "adv-r1" in a_rec.placement.rollout):
            assert time.monotonic() < deadline and not a_rec.state.terminal, a_rec
            await asyncio.sleep(0.5)

    def req(job: str, **kw) -> RolloutRequest:
        base = dict(job_id=job, request_id=f"{job}-s7-g0", step=7, group_index=0, group_seed=1,
                    policy_version=0, model=world.tiny_model, env="arith", group_size=2, engine="hf",
                    attempt=a_rec.attempt, sampling=SamplingParams(max_new_tokens=4, max_total_tokens=64))
        return RolloutRequest(**{**base, **kw})

    try:
        await world.service.publish(S.rollout("bob-job", "adv-r1"), req("bob-job", request_id=f"{job_id}-s7-g0"))
        await world.service.publish(S.rollout("bob-job", "adv-r1"), req("bob-job"))
        await world.service.publish(S.rollout(job_id, "adv-r1"), req(job_id, model="gpt2"))
        want = ("`request_id`", "no job 'bob-job'", "`model`: 'gpt2'")
        # 90 s: the worker reads these only between the groups it is sampling for alice's job,
        # and once, on 2 loaded cores, the last refusal had not come after 30 s (2026-11-27)
        letters = await dead_letters(world.service, "rollout", since,
                                     lambda d: all(any(x in e.reason for e in d) for x in want), timeout_s=90)
        for x in want:
            assert any(x in d.reason for d in letters), (x, letters)
    finally:
        if own is not None:
            await own.job.cancel("test over")
            own.follower.cancel()


async def test_the_workers_endpoint_shows_only_your_own_jobs(world):
    r = await world.api.get("/v1/workers", headers=bearer(world.bob_key))
    assert r.status_code == 200 and r.json(), r.text
    assert world.a_job not in r.text
    r = await world.api.get("/v1/workers", headers=ADMIN)
    rec = await world.alice.job(world.a_job).record()
    if not rec.state.terminal:  # an admin sees where alice's job runs
        assert world.a_job in r.text


async def test_spec_paths_outside_the_users_own_area_are_refused(world, home):
    victim_ckpt = home / "checkpoints" / world.a_job / "final"
    for spec, field_name in (
            (sft(world, sft_data=str(victim_ckpt / "adapter_model.safetensors")), "sft_data"),
            (sft(world, sft_data="/etc/passwd"), "sft_data"),
            (sft(world, sft_data="../../nats/auth/service.nk"), "sft_data"),
            ({"model": str(victim_ckpt), "env": "arith"}, "model"),
            ({"model": str(world.server.store_dir), "env": "arith"}, "model")):
        r = await world.api.post("/v1/jobs", json={"spec": spec}, headers=bearer(world.bob_key))
        assert r.status_code == 422, (spec, r.text)
        assert r.json()["detail"]["field"] == f"spec.{field_name}", r.text


async def test_specs_are_bounded_and_so_are_a_tenants_unfinished_jobs(world):
    for bad, field_name in (({"prompts_per_step": 10**9}, "prompts_per_step"), ({"steps": 10**12}, "steps"),
                            ({"group_size": 100_000}, "group_size"), ({"max_staleness": 10**6}, "max_staleness"),
                            ({"lora_rank": 1 << 20}, "lora_rank"), ({"eval_episodes": 10**8}, "eval_episodes"),
                            ({"sampling": {"max_new_tokens": 10**9}}, "sampling.max_new_tokens"),
                            ({"sampling": {"top_p": 0.5}}, "sampling.top_p")):
        r = await world.api.post("/v1/jobs", json={"spec": {"model": world.tiny_model, **bad}},
                                 headers=bearer(world.bob_key))
        assert r.status_code == 422 and r.json()["detail"]["field"] == f"spec.{field_name}", (bad, r.text)
    # jobs the pool can never hold (two rollout workers; it has one) wait without blocking
    # anyone, but one tenant may not queue without bound
    ids = []
    for _ in range(MAX_UNFINISHED):
        job = await world.bob.submit({"model": world.tiny_model, "env": "arith", "rollout_workers": 2})
        ids.append(job.id)
    r = await world.api.post("/v1/jobs", json={"spec": {"model": world.tiny_model, "rollout_workers": 2}},
                             headers=bearer(world.bob_key))
    assert r.status_code == 409 and "unfinished jobs" in r.json()["detail"]["error"], r.text
    for j in ids:
        assert (await world.bob.job(j).record()).state == JobState.QUEUED
        await world.bob.job(j).cancel("done probing")


async def test_the_recorder_survives_values_its_columns_cannot_hold(world):
    """A step >= 2**63 once crash-looped the recorder (int64 column, redelivered
    forever). Such a message is refused at decode now, by every service alike."""
    since = time.time()
    for raw in (msgspec.msgpack.encode({"job_id": "bob-x", "step": 2**63, "policy_version": 0, "values": {}}),
                msgspec.msgpack.encode({"job_id": "bob-x", "step": -1, "policy_version": 0, "values": {}})):
        await world.service.js.publish(S.job("bob-x", "metrics"), raw)
    letters = await dead_letters(world.service, "recorder", since, lambda d: len(d) >= 2)
    assert sum("`$.step`" in d.reason for d in letters) >= 2, letters
    assert world.procs["recorder"].poll() is None


async def test_a_revoked_key_is_refused_and_its_live_connection_closed_at_once(world):
    r = await world.api.post("/v1/users/bob/keys", json={"label": "to revoke"}, headers=ADMIN)
    key, kid = r.json()["key"], r.json()["key_id"]
    nc, errors = await user_connection(world.server.url, key)
    assert nc.is_connected, f"the new key's connection closed at once: {errors}"
    r = await world.api.delete(f"/v1/keys/{kid}", headers=bearer(world.bob_key))
    assert r.status_code == 200
    for _ in range(200):  # 20 s: the kick is one round trip, but a loaded 2-core CI machine stalls
        if nc.is_closed:
            break
        await asyncio.sleep(0.1)
    assert nc.is_closed, "the revoked key's connection is still open"
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(world.server.url, token=key, allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=5)


async def test_sft_query_cannot_read_the_service_key_or_the_process_environment(world):
    """Tried for real on a fresh `opentinker up`: a cast of read_text(<service nkey>) to
    INT failed and the job's `reason` carried the seed in full."""
    seed = world.server.service_seed_file.read_text().strip()
    for sql in (f"SELECT CAST(read_text('{world.server.service_seed_file}') AS INT) AS token_ids, 1 AS loss_mask",
                "SELECT CAST(content AS INT) AS token_ids, 1 AS loss_mask FROM read_text('/proc/self/environ')"):
        _, reason = await bob_job_fails(world, sft(world, sft_query=sql))
        assert "sft_query" in reason, reason
        assert seed not in reason and seed[:12] not in reason, reason
        assert "NATS_NKEY" not in reason and ADMIN_KEY not in reason, reason


async def test_sft_query_cannot_write_files_or_read_another_tenants_trajectories(world, tmp_path):
    target = tmp_path / "pwned.csv"
    _, reason = await bob_job_fails(world, sft(world, sft_query=f"COPY (SELECT 1) TO '{target}'"))
    assert "sft_query" in reason and not target.exists(), reason
    # alice's job has logged trajectories by now; bob's query sees none of them
    for _ in range(120):
        cols, rows = run_query(f"SELECT count(*) FROM trajectories WHERE job_id = '{world.a_job}'",
                               world.data_dir)
        if rows[0][0] > 0:
            break
        await asyncio.sleep(0.5)
    assert rows[0][0] > 0, "alice's job logged nothing"
    _, reason = await bob_job_fails(world, sft(world, sft_query=(
        f"SELECT token_ids, loss_mask FROM trajectories WHERE job_id = '{world.a_job}'")))
    assert "returned no rows" in reason, reason


# -- and alice never noticed -------------------------------------------------------------


async def test_an_operator_envs_data_dir_cannot_name_another_tenants_files(world):
    """Tried live before the fix: as bob, a gsm8k job with `data_dir` = alice's folder
    under <home>/users/ was accepted, completed, and trained on her only problem."""
    from opentinker.schemas import EnvInitReply, EnvInitRequest

    home = Path(os.environ["OPENTINKER_HOME"])
    answers = []
    for target in (home / "users" / "alice", home / "users" / "alice" / "no-such-folder", "/etc"):
        r = await world.api.post("/v1/jobs", headers=bearer(world.bob_key),
                                 json={"spec": {"env": "gsm8k", "env_args": {"data_dir": str(target)}}})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "spec.env_args.data_dir", r.text
        answers.append(r.json()["detail"]["error"].replace(repr(str(target)), "<path>"))
    assert len(set(answers)) == 1, answers  # nothing said about what exists there
    # and a request that reached the envhost some other way (a service's) is refused there
    job = await world.bob.submit({"name": "bob-owner", "model": world.tiny_model, "env": "arith", "steps": 1})
    await job.cancel("only its record is needed")
    reply = await world.service.request(S.env_init("gsm8k"), EnvInitRequest(
        env="gsm8k", env_args={"data_dir": str(home / "users" / "alice")}, job_id=job.id), EnvInitReply)
    assert "env_args.data_dir" in reply.error and not reply.state, reply


async def test_an_operator_envs_endpoint_and_key_arguments_cannot_reach_inside_or_borrow_secrets(world):
    """As bob, the operator's `simulated-user` env pointed at the bus's own monitor port (the
    operator's network, from the envhost's machine) or told to send one of the envhost's
    secrets (a variable of its process) as the endpoint's key: refused at the envhost,
    naming the argument and the operator's allowlist, before any request leaves it."""
    from opentinker.schemas import EnvInitReply, EnvInitRequest

    job = await world.bob.submit({"name": "bob-endpoint", "model": world.tiny_model, "env": "arith", "steps": 1})
    await job.cancel("only its record is needed")
    for args, field, allowlist in (
            ({"user_base_url": "http://127.0.0.1:8222/v1", "user_model": "m"}, "env_args.user_base_url",
             "envhost_allowed_urls"),
            ({"user_base_url": "http://allowed.example@127.0.0.1:8222/v1", "user_model": "m"},
             "env_args.user_base_url", "envhost_allowed_urls"),
            ({"user_api_key_env": "OPENTINKER_ADMIN_KEY", "user_model": "m"}, "env_args.user_api_key_env",
             "envhost_allowed_key_envs")):
        reply = await world.service.request(S.env_init("simulated-user"), EnvInitRequest(
            env="simulated-user", env_args=args, job_id=job.id), EnvInitReply)
        assert field in reply.error and allowlist in reply.error and not reply.state, reply


async def test_a_token_id_outside_the_vocabulary_is_refused_naming_the_prompt_and_the_worker_stays(world):
    """Tried live before the fix (Tinker's sample, issue 30): the rollout worker raised on
    token id 60000 and exited, and crash-looped on the redelivered request."""
    import httpx

    ep = await world.bob.submit_inference_job(model=world.tiny_model, engine="hf")
    try:
        async with httpx.AsyncClient(base_url=ep.url, headers=bearer(ep.token), timeout=120) as http:
            r = await http.post("/completions", json={"model": ep.model, "prompt": [1, 10**6], "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert "token id 1000000 is out of the model's vocabulary" in r.json()["error"]["message"], r.text
            ok = await http.post("/completions", json={"model": ep.model, "prompt": [1, 2, 3], "max_tokens": 2})
            assert ok.status_code == 200, ok.text
    finally:
        await ep.cancel()
    assert all(code is None for code in world.alive().values()), world.alive()


async def test_zz_alice_job_completed_with_its_own_metrics_and_no_service_restarted(world):
    rec = await world.alice.job(world.a_job).wait(timeout_s=600, raise_on_failure=False)
    assert rec.state == JobState.COMPLETED, (rec.reason, world.services.logs())
    await asyncio.wait_for(world.follower, 60)
    train = sorted((m for m in world.a_metrics if m.split == "train"), key=lambda m: m.step)
    assert [m.step for m in train] == list(range(A_STEPS)), [m.step for m in train]
    # each step's reward is exactly that of alice's own trajectories in the log, all from
    # her own learner's requests, sampled on the rollout worker her job was placed on
    for _ in range(60):
        _, rows = run_query(f"SELECT count(*) FROM trajectories WHERE job_id = '{world.a_job}' AND split = 'train'",
                            world.data_dir)
        if rows[0][0] >= A_STEPS * 4:
            break
        await asyncio.sleep(0.5)
    _, rows = run_query(
        "SELECT step, avg(reward), count(*), count(DISTINCT worker), min(request_id) FROM trajectories "
        f"WHERE job_id = '{world.a_job}' AND split = 'train' GROUP BY step ORDER BY step", world.data_dir)
    assert [r[0] for r in rows] == list(range(A_STEPS))
    for m, (step, reward, n, workers, rid) in zip(train, rows):
        assert n == 4 and workers == 1 and rid.startswith(f"{world.a_job}-s{step}-g"), (step, n, rid)
        assert m.values["reward_mean"] == pytest.approx(reward), (step, m.values["reward_mean"], reward)
    events = [e for e in await world.service.read_subject(S.job(world.a_job, "events"), JobStateChanged)]
    assert not any(e.state in (JobState.FAILED, JobState.CANCELLED) for e in events), events
    assert all(code is None for code in world.alive().values()), (world.alive(), world.services.logs())
