"""The capacity every tenant shares, tried as a hostile tenant would (issue 30, items 4,
5, 7 and 8): user bob, with an ordinary API key, against the Tinker API and the learners,
streams, object stores and engine locks alice's training job uses meanwhile (the
`world` stack, tests/tenants.py, which runs with small per-user limits: TINKER_*,
STORE_BYTES).

Each attack ends in a clear refusal naming the limit (a 400 or 429 from the Tinker API,
a failed future) or in bob's session ended by the service; alice's job completes with
every step (test_boundary.py's last test checks that) and no service exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import numpy as np
import pytest

from opentinker.schemas import JobState, decode
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import TinkerResult, TinkerSession
from opentinker.services.tinker import wire

from tinker_sdk import run_sdk
from tenants import (STORE_BYTES, TINKER_IDLE_S, TINKER_INFLIGHT_BYTES, TINKER_POLLS, alice_completed, alice_trains,
                     bearer)

tinker = pytest.importorskip("tinker")
pytestmark = pytest.mark.timeout(900)
ALICE_STEPS = 16


@pytest.fixture(scope="module")
async def alice(world):
    """Alice's job, training while this module's attacks run (her first may be over)."""
    return await alice_trains(world, "alice-capacity", ALICE_STEPS)


@contextlib.asynccontextmanager
async def tinker_http(w, key: str):
    async with httpx.AsyncClient(base_url=w.tinker_url, headers={"X-API-Key": f"tml-{key}"}, timeout=120) as http:
        yield http


async def open_model(http: httpx.AsyncClient, w) -> tuple[str, str, str]:
    """A session and its model 0 on the tiny model: (session id, model id, job id)."""
    r = await http.post("/api/v1/create_session", json={})
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    r = await http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0,
                                                      "base_model": w.tiny_model, "lora_config": {"rank": 4}})
    assert r.status_code == 200, r.text
    mid = r.json()["model_id"]
    return sid, mid, wire.job_of_model(mid)


async def finish(http: httpx.AsyncClient, sid: str, w=None, *jobs: str) -> None:
    """Finish session `sid`, then wait for its model jobs `jobs` to end (their learner
    takes the close once it holds them), so the next test starts with the learners free."""
    r = await http.post(f"/api/v1/sessions/{sid}/finish")
    assert r.status_code == 204, r.text
    deadline = time.monotonic() + 300
    for j in jobs:
        while not (await w.service.job_record(j))[0].state.terminal:
            assert time.monotonic() < deadline, (j, w.services.logs())
            await asyncio.sleep(1.0)


def fb_body(mid: str, seq: int, floats: int) -> bytes:
    """A forward_backward of one datum whose `weights` hold `floats` float32s (the
    learner fails it at once: the weights do not match its two tokens)."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    d = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2]),
                     loss_fn_inputs={"target_tokens": [2, 3],
                                     "weights": tinker.TensorData.from_numpy(np.ones(floats, np.float32))})
    req = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=[d], loss_fn="cross_entropy"),
        model_id=mid, seq_id=seq)
    return forward_backward_request_to_proto(req).SerializeToString()


async def test_an_idle_session_and_a_tinker_job_of_no_session_are_ended(world, alice):
    """Item 4: a session that beats but sends nothing held its learner forever, and a
    tinker job submitted over the REST API was never ended at all."""
    async with tinker_http(world, world.bob_key) as http:
        sid, _, job_id = await open_model(http, world)
        r = await world.api.post("/v1/jobs", headers=bearer(world.bob_key),
                                 json={"spec": {"algorithm": "tinker", "model": world.tiny_model, "lora_rank": 4}})
        assert r.status_code == 201, r.text
        orphan = r.json()["job_id"]
        beats = 0
        deadline = time.monotonic() + TINKER_IDLE_S + 240
        ended, reasons = {}, {}
        while time.monotonic() < deadline and len(ended) < 3:
            r = await http.post("/api/v1/session_heartbeat", json={"session_id": sid})  # alive, never idle
            beats += r.status_code == 200
            if r.status_code == 410:
                ended["session"] = True
            for j in (job_id, orphan):
                rec = (await world.service.job_record(j))[0]
                if rec.state.terminal:
                    ended[j], reasons[j] = rec.state, rec.reason
            await asyncio.sleep(5)
        assert beats >= 2, beats
        assert ended.get("session") and ended.get(job_id) and ended.get(orphan), (ended, world.services.logs())
        s = decode((await (await world.service.kv(S.KV_TINKER)).get(sid)).value, TinkerSession)
        assert s.finished_s > 0
        # ended as a closed session's model is: completed, its learner free
        assert ended[job_id] == JobState.COMPLETED and ended[orphan] == JobState.COMPLETED, (
            ended, reasons, world.services.logs())
    assert all(code is None for code in world.alive().values()), world.alive()


async def test_one_tenants_burst_of_operations_is_capped_in_flight(world, alice):
    """Item 5: OT_TINKER (discard old) let ~90 large forward_backward ops evict other
    tenants' unconsumed ops and results; now one user's ops and samples in flight (sent,
    futures not retrieved) are capped in count and bytes."""
    floats = 256 * 1024  # a 1 MiB weights tensor per op
    async with tinker_http(world, world.bob_key) as http:
        sid, mid, job = await open_model(http, world)
        try:
            accepted, refused = 0, None
            for seq in range(1, 3 * TINKER_INFLIGHT_BYTES // (4 * floats) + 1):
                r = await http.post("/api/v1/forward_backward", content=fb_body(mid, seq, floats),
                                    headers={"content-type": "application/x-protobuf"})
                if r.status_code == 429:
                    refused = r
                    break
                assert r.status_code == 200, r.text
                accepted += 1
            assert refused is not None, f"{accepted} ops of 1 MiB in flight, none refused"
            assert "tinker_inflight_bytes_per_user" in refused.json()["detail"], refused.text
            assert accepted * 4 * floats <= TINKER_INFLIGHT_BYTES, accepted
            assert refused.headers.get("retry-after"), refused.headers
            # alice's own ops are not bob's: her op is taken though his are at the cap
            async with tinker_http(world, world.alice_key) as ah:
                asid, amid, ajob = await open_model(ah, world)
                try:
                    r = await ah.post("/api/v1/forward_backward", content=fb_body(amid, 1, 16),
                                      headers={"content-type": "application/x-protobuf"})
                    assert r.status_code == 200, r.text
                finally:
                    await finish(http, sid, world, job)  # bob's first: his model may hold the learner hers needs
                    await finish(ah, asid, world, ajob)
        except BaseException:
            await http.post(f"/api/v1/sessions/{sid}/finish")
            raise
    assert all(code is None for code in world.alive().values()), world.alive()


async def test_stop_strings_are_bounded_and_bad_prompts_are_a_400(world, alice):
    """Items 5 and 7: a sample's `stop` was unbounded (each string re-decoded the whole
    prefix per token inside the engine lock every job of the base model shares)."""
    async with tinker_http(world, world.bob_key) as http:
        sid = (await http.post("/api/v1/create_session", json={})).json()["session_id"]
        r = await http.post("/api/v1/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 0,
                                                                     "base_model": world.tiny_model})
        assert r.status_code == 200, r.text
        sampler = r.json()["sampling_session_id"]
        try:
            def sample(stop, chunks=None) -> dict:
                return {"sampling_session_id": sampler, "seq_id": 1, "num_samples": 1,
                        "prompt": {"chunks": chunks or [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                        "sampling_params": {"max_tokens": 4, "stop": stop}}

            for stop, what in ((["never"] * 17, "stop strings"),  # schemas.tinker.MAX_STOP_STRINGS = 16
                               (["x" * 10_000], "characters"), ("y" * 10_000, "characters"),
                               (list(range(10_000)), "stop tokens")):
                r = await http.post("/api/v1/asample", json=sample(stop))
                assert r.status_code == 400, (what, r.status_code, r.text[:200])
                assert r.json()["detail"].startswith("sampling_params.stop") and what in r.json()["detail"], r.text
            # a malformed prompt chunk is the caller's fault: a 400 naming it, not a 500 (which the SDK retries)
            r = await http.post("/api/v1/asample", json=sample(None, [{"type": "encoded_text", "tokens": ["a"]}]))
            assert r.status_code == 400 and "prompt.chunks[0]" in r.json()["detail"], r.text
        finally:
            await finish(http, sid)


async def test_long_polls_are_capped_per_user_and_answered_by_push(world, alice):
    """Item 8: every open retrieve_future did a JetStream get every 50 ms, uncapped:
    1,000 polls on a future that never completes made ~20k NATS requests/s."""
    async with tinker_http(world, world.bob_key) as http:
        sid, mid, job_id = await open_model(http, world)
        try:
            n = TINKER_POLLS + 4
            t0 = time.monotonic()
            got = await asyncio.gather(*(http.post("/api/v1/retrieve_future",
                                                   json={"request_id": wire.request_id(job_id, 900 + i)})
                                         for i in range(n)))
            codes = sorted(r.status_code for r in got)
            assert codes == [200] * TINKER_POLLS + [429] * (n - TINKER_POLLS), codes
            refused = next(r for r in got if r.status_code == 429)
            assert "tinker_polls_per_user" in refused.json()["detail"], refused.text
            assert all(r.json().get("type") == "try_again" for r in got if r.status_code == 200)
            assert time.monotonic() - t0 < 120
            # a result is pushed to its waiting poll as it lands (a service publishes it here)
            rid = wire.request_id(job_id, 950)
            poll = asyncio.create_task(http.post("/api/v1/retrieve_future", json={"request_id": rid}))
            await asyncio.sleep(2.0)
            t1 = time.monotonic()
            await world.service.publish(S.tinker_result(job_id, 950),
                                        TinkerResult(job_id=job_id, seq_id=950, op="optim_step",
                                                     metrics={"x:mean": 1.0}))
            r = await poll
            assert r.status_code == 200 and r.json() == {"metrics": {"x:mean": 1.0}}, r.text
            assert time.monotonic() - t1 < 10
            # and a result that does not decode fails its future (a 5xx would be retried forever)
            await world.service.js.publish(S.tinker_result(job_id, 951), b"\xc1garbage")
            r = await http.post("/api/v1/retrieve_future", json={"request_id": wire.request_id(job_id, 951)})
            assert r.status_code == 200 and "does not decode" in r.json()["error"], r.text
        finally:
            await finish(http, sid, world, job_id)
    assert all(code is None for code in world.alive().values()), world.alive()


async def test_saves_are_capped_per_user(world, alice):
    """Item 5: `ot_weights` / `ot_checkpoints` had no limit, so one tenant's saves could
    fill the stores every job checkpoints to."""

    def saves(sc) -> tuple[int, str]:
        tc = sc.create_lora_training_client(base_model=world.tiny_model, rank=4, seed=0).result()
        for i in range(64):
            try:
                tc.save_state(f"s{i}").result()
            except tinker.RequestFailedError as e:
                return i, str(e)
        return 64, ""

    n, error = await asyncio.to_thread(run_sdk, world.tinker_url, f"tml-{world.bob_key}", saves)
    assert 1 <= n < 64 and "store_bytes_per_user" in error, (n, error)
    assert str(STORE_BYTES) in error, error
    assert all(code is None for code in world.alive().values()), world.alive()


async def test_zz_alices_job_completed_meanwhile(world, alice):
    await alice_completed(world, alice)
