"""A fuzz run against the running stack (tests/tenants.py): 10,000 malformed, oversized
and boundary-valued messages, made by a property-based generator (hypothesis), sent
while a job trains:

- 1,000 as a tenant (bob's API key) on every subject a tenant might try: the services'
  command subjects, job subjects (his own and alice's), KV and JetStream API subjects,
  environment subjects (the operator's, alice's own, his own), a made-up reply subject. A
  tenant may publish nothing, so each must be refused by nats-server (one "Permissions
  Violation" each).
- 9,000 as a service (the service nkey: a buggy or compromised service) on every subject
  a service consumes: job commands, learner assignments, job events, rollout requests,
  trajectories, weight events, metrics, environment RPC (the operator's `info` included)
  and the auth callout (whose subject nats-server itself refuses to every client). Each must be refused (a publish
  error, an error reply) or dead-lettered by a consumer with the reason; none may crash
  a service or touch the job that trains meanwhile.

Then the Tinker API path, with a session of bob's open (a model on a learner, a sampling
session on the rollout worker), 1,000 more drawn messages and a few hand-made ones:

- 100 as bob on his own session's ops, results and rollout subjects: each refused by
  nats-server.
- as a service: 400 TinkerOps on `ot.job.<job>.ops.<seq>` and `.ops.close` (each
  dead-lettered by the learner holding the session), 300 TinkerSamples (`Ot-Schema:
  TinkerSample`) on rollout subjects (each dead-lettered by the rollout worker, or, well
  formed, answered on its sampler's results subject), and 300 TinkerResults /
  TinkerSamples on `ot.job.<job|sampler>.results.<seq>`, whose futures bob then retrieves:
  each answered with HTTP 200 (an error for a result that does not decode), never a 5xx.
  The session then still trains, samples, closes and completes.

Every message carries a header `Ot-Fuzz: <n>` (`t<n>` on the Tinker path); dead letters
keep the original headers, so the accounting is per message. The counts are printed (run
with -s to see them).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from opentinker.schemas import (
    CancelJob, CancelReply, EnvCloseRequest, EnvInfoReply, EnvInfoRequest, EnvInitReply, EnvInitRequest,
    EnvResetReply, EnvResetRequest,
    EnvStepReply, EnvStepRequest, JobAssigned, JobSpec, JobState, JobStateChanged, Metrics, RolloutRequest,
    SubmitJob, SubmitReply, Trajectory, TurnRecord, WeightsPublished, decode, encode, schema_name,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import (AdamParams, SampledSequence, TinkerDatum, TinkerOp, TinkerResult,
                                       TinkerSample, TinkerSamples, TinkerTensor)
from opentinker.services.core.natsauth import CALLOUT_SUBJECT

from tenants import dead_letters, user_connection

pytestmark = pytest.mark.timeout(1200)

FUZZ_HEADER = "Ot-Fuzz"
N_USER = 1_000
JOBS = [f"fz-{i}" for i in range(4)]
LEARNER, ROLLOUT = "adv-l2", "adv-r1"

# -- what a valid message of each kind looks like (the fuzzer breaks these); their job id
# is none of the subjects' (a well-formed variant must still be refused for that) -------

SPEC = JobSpec(steps=1)
TRAJ = Trajectory(job_id="fz-template", request_id="fz-template-s0-g0", episode_id="fz-template-s0-g0-e0", step=0,
                  group_index=0, group_size=2, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -2.0],
                  prompt_len=1, turns=[TurnRecord(gen_start=1, gen_end=3, obs_end=3)], reward=1.0,
                  policy_version=0)
TEMPLATES: dict[str, msgspec.Struct] = {
    "submit": SubmitJob(spec=SPEC, api_key="otk-fuzz-" + "x" * 40),
    "cancel": CancelJob(job_id="fz-template", api_key="otk-fuzz-" + "x" * 40),
    "assign": JobAssigned(job_id="fz-template", spec=SPEC, attempt=1, rollout_workers=[ROLLOUT]),
    "events": JobStateChanged(job_id="fz-template", state=JobState.RUNNING, step=1, attempt=1, source="learner"),
    "rollout": RolloutRequest(job_id="fz-template", request_id="fz-template-s0-g0", step=0, group_index=0, group_seed=1,
                              policy_version=0, model="smollm2-135m-instruct", env="arith", attempt=1),
    "traj": TRAJ,
    "weights": WeightsPublished(job_id="fz-template", policy_version=1, kind="lora", uri="nats-os://ot_weights/x",
                                sha256="0" * 64, size_bytes=1),
    "metrics": Metrics(job_id="fz-template", step=0, policy_version=1, values={"reward_mean": 1.0}),
    "env_init": EnvInitRequest(env="arith", seed=1),
    "env_reset": EnvResetRequest(env="arith", episode_id="fz-e", job_id="fz-template"),
    "env_step": EnvStepRequest(episode_id="fz-nope", action="1", job_id="fz-template"),
    "env_close": EnvCloseRequest(episode_id="fz-nope", job_id="fz-template"),
    "env_info": EnvInfoRequest(env="arith"),
    "callout": None,
}
REPLY_TYPES = {"submit": SubmitReply, "cancel": CancelReply, "env_init": EnvInitReply,
               "env_reset": EnvResetReply, "env_step": EnvStepReply, "env_close": EnvStepReply,
               "env_info": EnvInfoReply}
# messages per kind sent as a service (9,000 in all)
COUNTS = {"submit": 700, "cancel": 700, "assign": 700, "events": 1000, "rollout": 1000, "traj": 1000,
          "weights": 800, "metrics": 1000, "env_init": 400, "env_reset": 400, "env_step": 400,
          "env_close": 400, "env_info": 300, "callout": 200}
assert sum(COUNTS.values()) == 9_000

EDGE_INTS = [-1, -(2**31), -(2**63), 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1]
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                    st.sampled_from(EDGE_INTS), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=40), st.binary(max_size=40))
junk = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=6), st.dictionaries(st.text(max_size=8), c,
                                                                                              max_size=6)),
                    max_leaves=24)


def _int_paths(obj: Any, path: tuple = ()) -> list[tuple]:
    """Paths (keys/indices) to every int (not bool) inside `obj` (a to_builtins tree)."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int):
        return [path]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _int_paths(v, (*path, k))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _int_paths(v, (*path, i))]
    return []


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    obj = dict(obj) if isinstance(obj, dict) else list(obj)
    obj[path[0]] = _set(obj[path[0]], path[1:], value)
    return obj


@st.composite
def bad_payload(draw, kind: str, template: msgspec.Struct | None = None) -> bytes:
    """One malformed, boundary-valued or mismatched payload for a message of `kind`
    (made from `template`, by default TEMPLATES[kind])."""
    template = template if template is not None else TEMPLATES[kind]
    if template is None:  # the auth callout: anything but a sealed authorization request
        return draw(st.one_of(st.binary(max_size=2000), junk.map(msgspec.msgpack.encode)))
    base = msgspec.to_builtins(template, builtin_types=(bytes,))  # bytes stay bytes (msgpack bin)
    # each variant's share: oversized ones are 1 in 21 (they are costly to send)
    how = draw(st.sampled_from(["bytes"] * 3 + ["junk"] * 3 + ["wrong_type"] * 4 + ["edge_int"] * 4
                               + ["missing"] * 3 + ["mismatch"] * 3 + ["huge"]))
    if how == "bytes":
        return draw(st.binary(min_size=0, max_size=4000))
    if how == "junk":
        value = draw(junk)
        if isinstance(value, dict) and set(value) >= set(base):
            value = [value]  # never a whole valid message by chance
        return msgspec.msgpack.encode(value)
    if how == "edge_int" and _int_paths(base):
        path = draw(st.sampled_from(_int_paths(base)))
        edge = draw(st.sampled_from([-1, -(2**63), 2**53 + 1, 2**63, 2**64 - 1]))
        return msgspec.msgpack.encode(_set(base, path, edge))
    if how == "missing":
        required = [f.name for f in msgspec.structs.fields(type(template)) if f.required]
        if required:
            field = draw(st.sampled_from(required))
            return msgspec.msgpack.encode({k: v for k, v in base.items() if k != field})
    if how == "mismatch" and "job_id" in base and kind not in ("submit", "cancel", "env_init", "env_reset",
                                                                 "env_step", "env_close", "env_info"):
        # well formed, but naming a job its subject does not
        return msgspec.msgpack.encode({**base, "job_id": draw(st.sampled_from(["fz-other", "alice-x", "a"]))})
    if how == "huge":
        # a 100,000-element array of uint64s (about 900 KB): over the command, event,
        # metrics and weights streams' limits, within the trajectory and rollout ones
        field = draw(st.sampled_from(sorted(base)))
        return msgspec.msgpack.encode({**base, field: [2**64 - 1] * 100_000})
    # wrong_type (and the fallbacks): a field of the wrong type
    field = draw(st.sampled_from(sorted(base)))
    value = base[field]
    wrong = draw(st.one_of(st.just([value]), st.just({"x": value}), st.integers(-5, 5).filter(
        lambda v: not isinstance(value, int) or isinstance(value, bool)), st.just("not-a-" + type(value).__name__)
        if not isinstance(value, str) else st.just(7)))
    return msgspec.msgpack.encode({**base, field: wrong})


def draw_all(strategy, n: int) -> list:
    """`n` examples of `strategy`, generated by hypothesis (seeded: the run repeats)."""
    out: list = []

    @settings(max_examples=n, database=None, deadline=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x) -> None:
        out.append(x)

    collect()
    assert len(out) >= n // 2, (len(out), n)
    return [out[i % len(out)] for i in range(n)]


def subject_of(kind: str, i: int, host_id: str) -> str:
    job = JOBS[i % len(JOBS)]
    return {"submit": S.SUBMIT, "cancel": S.CANCEL, "assign": S.assign_learner(LEARNER),
            "events": S.job(job, "events"), "rollout": S.rollout(job, ROLLOUT), "traj": S.job(job, "traj"),
            "weights": S.job(job, "weights"), "metrics": S.job(job, "metrics"),
            "env_init": S.env_init("arith"), "env_reset": S.env_reset("arith"), "env_step": S.env_step(host_id),
            "env_close": S.env_close(host_id), "env_info": S.env_info("arith"), "callout": CALLOUT_SUBJECT}[kind]


async def tenant_publishes(world, msgs: list[tuple[str, bytes, dict | None]]) -> int:
    """Publish `msgs` (subject, payload, headers) as bob, on his own NATS connection (a
    payload over the server's limit cut to 1 KiB); returns how many the server refused
    as a permissions violation (it answers each with an error, waited for up to 10 s)."""
    nc, errors = await user_connection(world.server.url, world.bob_key)
    for subject, payload, headers in msgs:
        if len(payload) > nc.max_payload:
            payload = payload[:1024]
        await nc.publish(subject, payload, headers=headers)
    await nc.flush()
    for _ in range(100):
        if len(errors) >= len(msgs):
            break
        await asyncio.sleep(0.1)
    await nc.close()
    return sum("permissions violation for publish" in e.lower() for e in errors)


async def test_ten_thousand_bad_messages_crash_nothing_and_are_each_refused_or_dead_lettered(world):
    svc = world.service
    # the job that trains while the fuzzer runs (alice's first job may be over by now)
    job = await world.alice.submit({"name": "alice-fuzzed", "model": world.tiny_model, "env": "arith",
                                    "engine": "hf", "steps": 6, "prompts_per_step": 2, "group_size": 2,
                                    "lora_rank": 4, "checkpoint_every": 3, "micro_batch_size": 4,
                                    "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}})
    host = await svc.request(S.env_reset("arith"), EnvResetRequest(env="arith", episode_id="fz-probe",
                                                                   job_id="fz-template", state={"a": 1, "b": 1}),
                             EnvResetReply)
    assert host.host_id and not host.error
    t_gen = time.monotonic()
    user_msgs = draw_all(st.tuples(st.sampled_from([
        S.SUBMIT, S.CANCEL, S.job("fz-bob", "events"), S.rollout(world.a_job, ROLLOUT), S.job(world.a_job, "traj"),
        "$KV.ot_users.bob", "$JS.API.STREAM.LIST", S.env_reset("arith"), S.assign_learner(LEARNER),
        CALLOUT_SUBJECT, "ot.dlq.scheduler",
        # the users' own env namespaces: a tenant may answer requests there, never send one,
        # nor make up a reply subject
        S.env_init("mygame", "alice"), S.env_info("mygame", "bob"), S.env_step("h1", "bob"), "_R_.FUZZ.x"]),
        st.one_of(*(bad_payload(k) for k in TEMPLATES))), N_USER)
    service_msgs = [(kind, payload) for kind, n in COUNTS.items() for payload in draw_all(bad_payload(kind), n)]
    # and past the server's max_payload (8 MB): refused before it leaves the client
    big = b"\x92" + b"\xff" * (8 * 1024 * 1024 + 1)
    for j in range(0, len(service_msgs), len(service_msgs) // 26):
        service_msgs[j] = (service_msgs[j][0], big)
    gen_s = time.monotonic() - t_gen

    # -- as a tenant: every publish refused by nats-server
    user_refused = await tenant_publishes(world, [(subject, payload, None) for subject, payload in user_msgs])

    # -- as a service: every message refused at publish, answered with an error, or
    # dead-lettered by the service that consumed it
    since = time.time()
    outcome: dict[int, str] = {}
    replies: dict[int, bytes] = {}
    inbox = svc.nc.new_inbox()

    async def on_reply(m) -> None:
        replies[int(m.subject.rsplit(".", 1)[1])] = m.data

    reply_sub = await svc.nc.subscribe(f"{inbox}.*", cb=on_reply)
    # nats-server lets no client publish on the auth callout's subject, not even a
    # service: those publishes go on a connection of their own, to count its refusals
    callout_errors: list[str] = []

    async def on_callout_error(e) -> None:
        callout_errors.append(str(e))

    callout_nc = await nats.connect(world.server.url, nkeys_seed=str(world.server.service_seed_file),
                                    error_cb=on_callout_error, allow_reconnect=False)
    kinds: dict[int, str] = {}
    t0 = time.monotonic()
    for n, (kind, payload) in enumerate(service_msgs):
        kinds[n] = kind
        subject = subject_of(kind, n, host.host_id)
        headers = {FUZZ_HEADER: str(n)}
        try:
            if kind == "callout":
                await callout_nc.publish(subject, payload, reply=f"{inbox}.{n}", headers=headers)
            elif kind in REPLY_TYPES:
                await svc.nc.publish(subject, payload, reply=f"{inbox}.{n}", headers=headers)
            else:
                await svc.js.publish(subject, payload, headers=headers, timeout=10)
        except nats.errors.MaxPayloadError:
            outcome[n] = "refused: over max_payload"
        except nats.js.errors.APIError as e:
            outcome[n] = f"refused: {e.description}"
    await svc.nc.flush()
    await callout_nc.flush()
    publish_s = time.monotonic() - t0
    sent_to_callout = [n for n, k in kinds.items() if k == "callout" and n not in outcome]
    for _ in range(50):
        if len(callout_errors) >= len(sent_to_callout):
            break
        await asyncio.sleep(0.1)
    await callout_nc.close()
    if sum(f'publish to "{CALLOUT_SUBJECT.lower()}"' in e.lower() for e in callout_errors) == len(sent_to_callout):
        outcome.update({n: "refused: by nats-server (the callout subject)" for n in sent_to_callout})

    def settled(letters) -> bool:
        lettered = {int(d.headers.get(FUZZ_HEADER, -1)) for d in letters}
        return all(n in outcome or n in replies or n in lettered for n in kinds)

    letters = await dead_letters(svc, "*", since, settled, timeout_s=300)
    await reply_sub.unsubscribe()
    lettered: dict[int, set[str]] = {}
    for d in letters:
        if FUZZ_HEADER in d.headers:
            lettered.setdefault(int(d.headers[FUZZ_HEADER]), set()).add(d.service)
    accepted = []  # a reply that did not refuse: a bad message taken as good
    for n, data in replies.items():
        kind = kinds[n]
        try:
            reply = decode(data, REPLY_TYPES[kind])
        except (msgspec.MsgspecError, KeyError):
            accepted.append((n, kind, data[:200]))
            continue
        if getattr(reply, "ok", False) or (hasattr(reply, "error") and not reply.error and kind != "env_close") \
                or getattr(reply, "host_id", "") and kind == "env_info":
            accepted.append((n, kind, reply))
        outcome.setdefault(n, "refused: error reply")
    for n in lettered:
        outcome.setdefault(n, "dead-lettered")
    unaccounted = [(n, kinds[n], service_msgs[n][1][:80]) for n in kinds if n not in outcome]
    by_kind = Counter((kinds[n], outcome[n].split(":")[0]) for n in outcome)
    print(f"\nfuzz: generated {N_USER + len(service_msgs)} messages in {gen_s:.1f} s; as a tenant "
          f"{N_USER} sent, {user_refused} refused by nats-server; as a service {len(service_msgs)} sent in "
          f"{publish_s:.1f} s: {sum(o == 'dead-lettered' for o in outcome.values())} dead-lettered, "
          f"{sum(o.startswith('refused') for o in outcome.values())} refused "
          f"({sum(o == 'refused: error reply' for o in outcome.values())} by an error reply); "
          f"unaccounted {len(unaccounted)}; accepted {len(accepted)}")
    print("by kind:", dict(sorted(by_kind.items())))

    assert user_refused == N_USER, f"{user_refused} of {N_USER} refused by nats-server"
    assert not accepted, accepted[:5]
    assert not unaccounted, unaccounted[:5]
    # nothing crashed, and the job that trained meanwhile completed, every step reported
    rec = await job.wait(timeout_s=600, raise_on_failure=False)
    assert rec.state == JobState.COMPLETED, (rec.reason, world.services.logs())
    steps = sorted(m.step for m in await svc.read_subject(S.job(job.id, "metrics"), Metrics) if m.split == "train")
    assert steps == list(range(6)), steps
    assert all(code is None for code in world.alive().values()), (world.alive(), world.services.logs())


# -- the Tinker API path: a session's ops, its futures' results, its samples ------------

TINKER_COUNTS = {"op": 300, "close": 100, "result": 200, "samples": 100, "sample": 300}
RESULT_SEQ, SAMPLE_SEQ = 100_000, 200_000  # the fuzzed results' seq ids, and the fuzzed samples' answers'
TINKER_DEAD_LETTERER = {"op": "learner", "close": "learner", "sample": "rollout"}
N_USER_TINKER = 100


def tinker_templates(job: str, sampler: str, sampling_job: str, attempt: int) -> dict[str, msgspec.Struct]:
    """A valid message of each kind of the Tinker path, for bob's session (model job
    `job`; sampling session `sampler`, served by `sampling_job` at `attempt`). An op names
    its job but is never sent on its own subject (seq 1, sent on ops.7 or ops.close): no
    fuzzed op executes; a close names another job: none ends the session."""
    datum = TinkerDatum(tokens=[1, 2, 3], inputs={
        "target_tokens": TinkerTensor(dtype="int64", shape=[3], data=struct.pack("<3q", 2, 3, 4)),
        "weights": TinkerTensor(dtype="float32", data=struct.pack("<3f", 1.0, 1.0, 1.0))})
    return {"op": TinkerOp(job_id=job, seq_id=1, op="forward_backward", data=[datum], loss_fn="cross_entropy",
                           loss_fn_config={"beta": 0.1}, adam=AdamParams(), name="fz", path=f"{job}/fz"),
            "close": TinkerOp(job_id="fz-template", seq_id=0, op="close"),
            "result": TinkerResult(job_id=job, seq_id=1, op="forward_backward", metrics={"loss:sum": 1.0},
                                   logprobs=[TinkerTensor(dtype="float32", shape=[3],
                                                          data=struct.pack("<3f", -0.5, -1.0, -2.0))]),
            "samples": TinkerSamples(sampler=sampler, seq_id=1, prompt_logprobs=[-1.0, -2.0], sequences=[
                SampledSequence(tokens=[5, 6], logprobs=[-0.5, -1.0], stop_reason="length")]),
            "sample": TinkerSample(job_id=sampling_job, sampler=sampler, seq_id=1, attempt=attempt, tokens=[1, 2, 3],
                                   max_tokens=4, stop_tokens=[2], stop_strings=["x"])}


def tinker_subject(kind: str, n: int, job: str, sampler: str, sampling_job: str) -> str:
    if kind == "op":
        return S.tinker_close(job) if n % 3 == 0 else S.tinker_op(job, 7)
    if kind == "close":
        return S.tinker_close(job) if n % 4 else S.tinker_op(job, 9)
    if kind == "result":  # each its own future, retrieved below
        return S.tinker_result(job, RESULT_SEQ + n)
    if kind == "samples":
        return S.tinker_result(sampler, RESULT_SEQ + n)
    # a sample: on its sampling job's subject, 1 in 4 on another job's
    return S.rollout(sampling_job if n % 4 else JOBS[(n // 4) % len(JOBS)], ROLLOUT)


def _with_seq(payload: bytes, seq: int) -> bytes:
    """`payload` with seq_id `seq` if it decodes as a TinkerSample (a worker that serves
    it answers on `results.<seq>`: each answer is told apart), else as it is."""
    try:
        decode(payload, TinkerSample)
    except msgspec.MsgspecError:
        return payload
    return msgspec.msgpack.encode({**msgspec.msgpack.decode(payload), "seq_id": seq})


def _decodes(payload: bytes, kind: type) -> bool:
    try:
        decode(payload, kind)
        return True
    except msgspec.MsgspecError:
        return False


async def _tinker_answer(http: httpx.AsyncClient, rid: str) -> tuple[int, Any]:
    """retrieve_future(`rid`): (HTTP status, the JSON body, the protobuf bytes or the
    text); status 0 and the error when the service does not answer at all."""
    for attempt in range(3):  # a pooled connection the server closed (after a 500, say): once more
        try:
            r = await http.post("/api/v1/retrieve_future", json={"request_id": rid})
            break
        except httpx.TransportError as e:
            if attempt == 2:
                return 0, repr(e)
            await asyncio.sleep(0.5)
    if r.headers.get("content-type", "").startswith("application/json"):
        try:
            return r.status_code, r.json()
        except ValueError:
            pass
    return r.status_code, r.content if r.status_code == 200 else r.text[:300]


def _tracebacks(log_dir: Path, pattern: str = "tinker-*.log") -> list[str]:
    """The tracebacks in the logs of the services `pattern` names (each with the line
    before it, which says what failed)."""
    out = []
    for f in sorted(log_dir.glob(pattern)):
        lines = f.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Traceback (most recent call last)"):
                end = next((j for j in range(i + 1, len(lines)) if lines[j] and not lines[j][0].isspace()
                            and not lines[j].startswith(("Traceback", "During handling", "The above"))), len(lines))
                out.append("\n".join(lines[max(i - 1, 0):end + 1]))
    return out


async def _until_answered(http: httpx.AsyncClient, rid: str, timeout_s: float) -> tuple[int, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = await _tinker_answer(http, rid)
        if not (status == 200 and isinstance(body, dict) and body.get("type") == "try_again") \
                or time.monotonic() > deadline:
            return status, body


async def test_bad_tinker_ops_results_and_samples_are_each_refused_or_answered_with_an_error(world):
    """The Tinker API path, with a session of bob's open (a model placed on a learner, a
    sampling session on the rollout worker):

    - as a tenant, bob publishes on his own session's subjects: each refused by nats-server;
    - as a service: TinkerOps on `ot.job.<job>.ops.<seq>` / `.ops.close` (each dead-lettered
      by the learner holding the session), TinkerSamples with `Ot-Schema: TinkerSample` on
      rollout subjects (each dead-lettered by the rollout worker, or, well formed, answered
      on the sampler's results), TinkerResults / TinkerSamples on `ot.job.<job|sampler>.
      results.<seq>` (each future then answered by the tinker service: a malformed result
      with an error, HTTP 200, never a 5xx);
    - afterwards the session still trains and samples, closes and completes; no service exits.
    """
    svc = world.service
    http = httpx.AsyncClient(base_url=world.tinker_url, timeout=60, headers={"X-API-Key": f"tml-{world.bob_key}"})
    r = await http.post("/api/v1/create_session", json={})
    assert r.status_code == 200, r.text
    session = r.json()["session_id"]

    async def beat() -> None:
        while True:
            await asyncio.sleep(10)
            with contextlib.suppress(httpx.HTTPError):
                await http.post("/api/v1/session_heartbeat", json={"session_id": session})

    beating = asyncio.create_task(beat())
    job, sampling_job = f"{session}-m0", f"{session}-sampling"
    finished = False
    try:
        r = await http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                          "base_model": world.tiny_model, "lora_config": {"rank": 4}})
        assert r.status_code == 200, r.text
        mid = r.json()["model_id"]
        r = await http.post("/api/v1/create_sampling_session", json={"session_id": session,
                                                                     "sampling_session_seq_id": 0,
                                                                     "base_model": world.tiny_model})
        assert r.status_code == 200, r.text
        sampler = r.json()["sampling_session_id"]
        # the model is ready once its learner holds it (one of two: alice's job may hold the other)
        status, ready = await _until_answered(http, f"{job}.0", timeout_s=600)
        assert status == 200 and ready == {"model_id": mid}, (status, ready, world.services.logs())
        for _ in range(600):
            rec, _ = await svc.job_record(sampling_job)
            if rec.placement is not None and rec.placement.rollout:
                break
            await asyncio.sleep(0.2)
        assert rec.placement.rollout == [ROLLOUT], rec
        attempt = rec.attempt

        templates = tinker_templates(job, sampler, sampling_job, attempt)
        t_gen = time.monotonic()
        msgs = [(kind, payload) for kind, n in TINKER_COUNTS.items()
                for payload in draw_all(bad_payload(kind, templates[kind]), n)]
        # and past the server's max_payload: refused before it leaves the client
        big = b"\x92" + b"\xff" * (8 * 1024 * 1024 + 1)
        firsts = {}
        for n, (kind, _) in enumerate(msgs):
            firsts.setdefault(kind, n)
        for n in firsts.values():
            msgs[n] = (msgs[n][0], big)
        msgs = [(kind, _with_seq(p, SAMPLE_SEQ + n) if kind == "sample" else p) for n, (kind, p) in enumerate(msgs)]
        gen_s = time.monotonic() - t_gen
        # well formed, each naming the wrong job, subject, attempt or sampler (`why`: the
        # dead letter's reason says so), or a prompt the worker answers with an error
        extras: list[tuple[str, str, msgspec.Struct, str]] = [
            ("op", S.tinker_op(job, 4), TinkerOp(job_id=job, seq_id=3, op="optim_step", adam=AdamParams()), "came on"),
            ("op", S.tinker_op(job, 2), TinkerOp(job_id=job, seq_id=2, op="close"), "came on"),
            ("op", S.tinker_close(job), TinkerOp(job_id=job, seq_id=5, op="save_state", name="fz"), "came on"),
            ("op", S.tinker_op(job, 1), TinkerOp(job_id=world.a_job, seq_id=1, op="forward"), "came on"),
            ("close", S.tinker_close(job), TinkerOp(job_id=world.a_job, seq_id=0, op="close"), "came on"),
            ("sample", S.rollout(job, ROLLOUT), TinkerSample(job_id=job, sampler=sampler, seq_id=SAMPLE_SEQ - 1,
                                                             attempt=1, tokens=[1]), "not an inference job"),
            ("sample", S.rollout(sampling_job, ROLLOUT), TinkerSample(
                job_id=sampling_job, sampler=sampler, seq_id=SAMPLE_SEQ - 3, attempt=attempt + 1, tokens=[1]),
             f"at attempt {attempt + 1}"),
            ("sample", S.rollout(sampling_job, ROLLOUT), TinkerSample(
                job_id=sampling_job, sampler="Not.A-Sampler", seq_id=1, attempt=attempt, tokens=[1]), "`sampler`"),
            ("sample", S.rollout("fz-nojob", ROLLOUT), TinkerSample(job_id="fz-nojob", sampler=sampler,
                                                                    seq_id=SAMPLE_SEQ - 4, tokens=[1]), "no job"),
            ("sample", S.rollout(sampling_job, ROLLOUT), TinkerSample(
                job_id=sampling_job, sampler=sampler, seq_id=SAMPLE_SEQ - 5, attempt=attempt, tokens=[2**31 - 1]),
             "answered: vocabulary"),
            ("sample", S.rollout(sampling_job, ROLLOUT), TinkerSample(
                job_id=sampling_job, sampler=sampler, seq_id=SAMPLE_SEQ - 6, attempt=attempt, tokens=[]),
             "answered: prompt"),
        ]

        # -- as a tenant, on his own session's subjects: every publish refused by nats-server
        user_subjects = [S.tinker_op(job, 1), S.tinker_close(job), S.tinker_result(job, 1),
                         S.tinker_result(sampler, 1), S.rollout(sampling_job, ROLLOUT)]
        user_refused = await tenant_publishes(world, [
            (user_subjects[i % len(user_subjects)], msgs[(i * 7919) % len(msgs)][1][:4096],
             {S.H_SCHEMA: "TinkerSample"}) for i in range(N_USER_TINKER)])

        # -- as a service
        answers: dict[int, bytes] = {}  # a sample's seq id -> the worker's answer (its results subject)

        async def on_answer(m) -> None:
            answers[int(m.subject.rsplit(".", 1)[1])] = m.data

        answer_sub = await svc.nc.subscribe(f"ot.job.{sampler}.results.*", cb=on_answer)
        since = time.time()
        outcome: dict[int, str] = {}
        kinds: dict[int, str] = {}
        subjects: dict[int, str] = {}
        payloads: dict[int, bytes] = {}
        expected: dict[int, str] = {}
        t0 = time.monotonic()
        sends = [(kind, tinker_subject(kind, n, job, sampler, sampling_job), p) for n, (kind, p) in enumerate(msgs)]
        sends += [(kind, subject, encode(msg), why) for kind, subject, msg, why in extras]
        for n, (kind, subject, payload, *why) in enumerate(sends):
            kinds[n], subjects[n], payloads[n] = kind, subject, payload
            if why:
                expected[n] = why[0]
            headers = {FUZZ_HEADER: f"t{n}", S.H_SCHEMA: schema_name(type(templates[kind]))}
            try:
                await svc.js.publish(subject, payload, headers=headers, timeout=10)
            except nats.errors.MaxPayloadError:
                outcome[n] = "refused: over max_payload"
            except nats.js.errors.APIError as e:
                outcome[n] = f"refused: {e.description}"
        publish_s = time.monotonic() - t0

        def answer_seq(payload: bytes) -> int | None:
            """The seq id a rollout worker would answer a sample on (None: undecodable)."""
            try:
                return decode(payload, TinkerSample).seq_id
            except msgspec.MsgspecError:
                return None

        seqs = {n: answer_seq(payloads[n]) for n in kinds if kinds[n] == "sample"}
        consumed = [n for n in kinds if kinds[n] in TINKER_DEAD_LETTERER and n not in outcome]

        def lettered_of(letters) -> dict[int, list]:
            out: dict[int, list] = {}
            for d in letters:
                h = d.headers.get(FUZZ_HEADER, "")
                if h.startswith("t"):
                    out.setdefault(int(h[1:]), []).append(d)
            return out

        def settled(letters) -> bool:
            lettered = lettered_of(letters)
            return all(n in lettered or (kinds[n] == "sample" and seqs[n] in answers) for n in consumed)

        letters = await dead_letters(svc, "*", since, settled, timeout_s=300)
        await answer_sub.unsubscribe()
        lettered = lettered_of(letters)
        wrong_letterer, wrong_reason, unaccounted = [], [], []
        for n in consumed:
            kind = kinds[n]
            if n in lettered:
                outcome[n] = "dead-lettered"
                d = lettered[n][0]
                if {x.service for x in lettered[n]} != {TINKER_DEAD_LETTERER[kind]} or not d.reason:
                    wrong_letterer.append((n, kind, [(x.service, x.reason[:120]) for x in lettered[n]]))
                if n in expected and expected[n] not in d.reason:
                    wrong_reason.append((n, kind, expected[n], d.reason[:200]))
            elif kind == "sample" and seqs[n] in answers:
                outcome[n] = "answered"
                if n in expected and not expected[n].startswith("answered: "):
                    wrong_reason.append((n, kind, expected[n], "answered"))
            else:
                unaccounted.append((n, kind, subjects[n], payloads[n][:80]))

        # -- every future the fuzzed results (and the samples served) answer, by the tinker
        # service: an answer (an error for what does not decode), HTTP 200, never a 5xx
        retrieved: dict[int, tuple[int, Any]] = {}
        gate = asyncio.Semaphore(4)

        async def get(n: int, rid: str) -> None:
            async with gate:
                retrieved[n] = await _tinker_answer(http, rid)

        futures = {n: (f"{job}.{RESULT_SEQ + n}" if kinds[n] == "result" else f"{sampler}.{RESULT_SEQ + n}")
                   for n in kinds if kinds[n] in ("result", "samples") and n not in outcome}
        futures |= {n: f"{sampler}.{seqs[n]}" for n in kinds if outcome.get(n) == "answered"}
        t1 = time.monotonic()
        await asyncio.gather(*(get(n, rid) for n, rid in futures.items()))
        retrieve_s = time.monotonic() - t1
        server_errors, no_error = [], []
        for n, (status, body) in sorted(retrieved.items()):
            kind = kinds[n]
            malformed = kind in ("result", "samples") and not _decodes(
                payloads[n], TinkerResult if kind == "result" else TinkerSamples)
            if status >= 500 or status == 0 or (isinstance(body, dict) and body.get("type") == "try_again"):
                server_errors.append((n, kind, futures[n], status, body if isinstance(body, (dict, str)) else "bytes",
                                      payloads[n][:60]))
            elif kind in ("result", "samples"):
                outcome[n] = ("answered: error" if isinstance(body, dict) and "error" in body
                              else f"answered: HTTP {status}" if status != 200 else "answered")
                if malformed and outcome[n] != "answered: error":
                    no_error.append((n, kind, status, body if isinstance(body, (dict, str)) else body[:60]))
            elif n in expected and expected[n].startswith("answered: "):
                word = expected[n].removeprefix("answered: ")
                if not (status == 200 and isinstance(body, dict) and word in body.get("error", "")):
                    wrong_reason.append((n, kind, expected[n], status, body))
        # the same future twice: a server error on a result is for good (the stream keeps it)
        again = [(n, await _tinker_answer(http, futures[n])) for n, *_ in server_errors[:3]]
        unretrieved = [n for n in futures if n not in retrieved]

        by_kind = Counter((kinds[n], outcome.get(n, "?").split(":")[0]) for n in kinds)
        print(f"\ntinker fuzz: generated {len(msgs)} in {gen_s:.1f} s; as a tenant {N_USER_TINKER} sent, "
              f"{user_refused} refused; as a service {len(sends)} sent in {publish_s:.1f} s: "
              f"{sum(o == 'dead-lettered' for o in outcome.values())} dead-lettered, "
              f"{sum(o.startswith('refused') for o in outcome.values())} refused, "
              f"{sum(o.startswith('answered') for o in outcome.values())} answered; "
              f"{len(retrieved)} futures retrieved in {retrieve_s:.1f} s, {len(server_errors)} server errors, "
              f"{len(no_error)} malformed results answered without an error; "
              f"unaccounted {len(unaccounted)}")
        print("by kind:", dict(sorted(by_kind.items())))
        for n, kind, rid, status, body, head in server_errors[:5]:
            print(f"  server error: {kind} #{n} future {rid}: HTTP {status} {str(body)[:120]!r} (payload {head!r})")
        tracebacks = _tracebacks(world.services.log_dir)
        if tracebacks:
            print(f"the tinker service's log holds {len(tracebacks)} tracebacks; the first:\n{tracebacks[0]}")

        # the session goes on after all that: an op executes in order, a prompt is sampled
        r = await http.post("/api/v1/optim_step", json={"model_id": mid, "seq_id": 1,
                                                        "adam_params": {"learning_rate": 1e-4}})
        assert r.status_code == 200, r.text
        step = await _until_answered(http, r.json()["request_id"], timeout_s=300)
        r = await http.post("/api/v1/asample", json={
            "sampling_session_id": sampler, "seq_id": 1, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4}})
        assert r.status_code == 200, r.text
        sampled = await _until_answered(http, r.json()["request_id"], timeout_s=300)
        r = await http.post(f"/api/v1/sessions/{session}/finish")
        finished = r.status_code == 204
        assert finished, r.text
    finally:
        beating.cancel()
        if not finished:
            with contextlib.suppress(httpx.HTTPError):
                await http.post(f"/api/v1/sessions/{session}/finish")
        # the learner is freed for the tests after this one
        for _ in range(900):
            got = [await svc.job_record(j) for j in (job, sampling_job)]
            if all(g is None or g[0].state.terminal for g in got):
                break
            await asyncio.sleep(0.2)
        await http.aclose()

    assert user_refused == N_USER_TINKER, f"{user_refused} of {N_USER_TINKER} refused by nats-server"
    assert not unaccounted, unaccounted[:5]
    assert not wrong_letterer, wrong_letterer[:5]
    assert not wrong_reason, wrong_reason[:5]
    assert not unretrieved, unretrieved[:5]
    assert step[0] == 200 and isinstance(step[1], dict) and "metrics" in step[1], step
    assert sampled[0] == 200 and isinstance(sampled[1], bytes), sampled
    assert got[0] is not None and got[0][0].state == JobState.COMPLETED, (got[0], world.services.logs())
    assert got[1] is not None and got[1][0].state == JobState.CANCELLED, got[1]
    assert all(code is None for code in world.alive().values()), (world.alive(), world.services.logs())
    assert not no_error, no_error[:5]
    assert not server_errors, (f"{len(server_errors)} futures answered with a server error, e.g. "
                               f"{server_errors[:3]}; asked again: {again}; the tinker service's first traceback "
                               f"(of {len(tracebacks)}):\n{tracebacks[0] if tracebacks else '(none)'}")


# -- the replies of a tenant's own envhost: untrusted input to the rollout ----------------

REPLY_TEMPLATES = {"init": EnvInitReply(state={"a": 1, "b": 2}),
                   "reset": EnvResetReply(host_id="bob-fz", system_prompt="Add.", user_message="1 + 2?"),
                   "step": EnvStepReply(observation="", reward=1.0, done=True, info={"correct": True})}


@st.composite
def bad_reply(draw, kind: str) -> bytes:
    """One reply of a hostile env to a `kind` request: malformed, of the wrong types,
    over schemas.env's limits, or (1 in 8) well formed, so episodes reach later calls."""
    base = msgspec.to_builtins(REPLY_TEMPLATES[kind])
    how = draw(st.sampled_from(["ok", "bytes", "junk", "wrong_type", "edge", "edge", "limit", "limit"]))
    if how == "ok":
        return msgspec.msgpack.encode(base)
    if how == "bytes":
        return draw(st.binary(max_size=2000))
    if how == "junk":
        return msgspec.msgpack.encode(draw(junk))
    if how == "wrong_type":
        field = draw(st.sampled_from(sorted(base)))
        return msgspec.msgpack.encode({**base, field: draw(st.one_of(st.just([1]), st.just({"x": 1}), st.just(7)))})
    if how == "edge":  # values no column holds, NaN and infinities
        field, value = draw(st.sampled_from([("reward", float("nan")), ("reward", float("inf")), ("reward", 2**64 - 1),
                                             ("done", 1), ("schema_version", -1), ("host_id", "a.b"),
                                             ("host_id", "x" * 300), ("state", {"a": float("nan")}),
                                             ("info", {"a": [2**63]})]))
        return msgspec.msgpack.encode({**base, field: value})
    field, value = draw(st.sampled_from([  # over schemas.env's limits, within the payload limit
        ("observation", "x" * 300_000), ("system_prompt", "y" * 300_000), ("user_message", "z" * 300_000),
        ("tools", [{"name": "t"}] * 100), ("images", [b"\x89PNG"] * 20), ("info", {"k": "v" * 70_000}),
        ("observations", {f"s{i}": "" for i in range(40)}), ("rewards", {"s": float("nan")})]))
    return msgspec.msgpack.encode({**base, field: value})


async def test_bad_replies_of_a_tenants_own_env_fail_only_its_episodes_and_crash_nothing(world):
    """Bob's envhost (written by hand against the bus) answers every request of his job
    with a drawn reply; each episode ends with a reason or a finite reward, his job ends,
    and no service exits."""
    replies = {k: draw_all(bad_reply(k), 300) for k in REPLY_TEMPLATES}
    counter = Counter()
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))

    nc = await nats.connect(world.server.url, token=world.bob_key, error_cb=on_error, max_reconnect_attempts=-1)

    def answer(kind: str):
        async def cb(m) -> None:
            payload = replies[kind][counter[kind] % len(replies[kind])]
            counter[kind] += 1
            await m.respond(payload)
        return cb

    async def info(m) -> None:
        await m.respond(msgspec.msgpack.encode(msgspec.to_builtins(EnvInfoReply(env="fuzzenv", host_id="bob-fz"))))

    for subject, cb in ((S.env_info("fuzzenv", "bob"), info), (S.env_init("fuzzenv", "bob"), answer("init")),
                        (S.env_reset("fuzzenv", "bob"), answer("reset")),
                        (S.env_step("bob-fz", "bob"), answer("step"))):
        await nc.subscribe(subject, cb=cb)
    await nc.flush()
    try:
        job = await world.bob.submit({"name": "bob-fuzzenv", "model": world.tiny_model, "env": "fuzzenv",
                                      "engine": "hf", "steps": 3, "prompts_per_step": 4, "group_size": 2,
                                      "lora_rank": 4, "checkpoint_every": 100, "micro_batch_size": 4,
                                      "rollout_timeout_s": 10,
                                      "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}})
        rec = await job.wait(timeout_s=600, raise_on_failure=False)
    finally:
        await nc.close()
    trajs = await world.service.read_subject(S.job(job.id, "traj"), Trajectory)
    print(f"\nreply fuzz: {dict(counter)} replies sent; {len(trajs)} episodes, "
          f"{sum(bool(t.error) for t in trajs)} ended with a reason; job {rec.state.value}: {rec.reason[:200]}")
    assert rec.state in (JobState.COMPLETED, JobState.FAILED), rec
    assert rec.state == JobState.COMPLETED or "attempts" in rec.reason, rec.reason
    assert sum(counter.values()) > 30 and trajs
    assert all(t.error or math.isfinite(t.reward) for t in trajs)
    assert any("over the limit" in t.error for t in trajs) and any("unreadable" in t.error for t in trajs)
    assert all(code is None for code in world.alive().values()), (world.alive(), world.services.logs())
