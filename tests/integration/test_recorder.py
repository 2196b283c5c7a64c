"""The recorder as a real subprocess: bus messages become Parquet that DuckDB queries,
bad messages are dead-lettered, and restarts (clean or killed) neither lose nor
double a row."""

import asyncio
import shutil
import time

import msgspec
import pyarrow.parquet as pq
from nats.js.api import DeliverPolicy

from opentinker.schemas import DeadLetter, JobState, JobStateChanged, Metrics, Trajectory, TurnRecord, decode
from opentinker.schemas import subjects as S
from opentinker.services.core.logdb import connect, run_query

FAST = ("recorder_flush_s=0.3", "recorder_ack_wait_s=3")


def traj(job_id, step, i, reward):
    return Trajectory(
        job_id=job_id, request_id=f"{job_id}-r{step}", episode_id=f"{job_id}-s{step}-e{i}", step=step,
        group_index=0, group_size=4, token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 0],
        logprobs=[0.0, 0.0, -0.5, -0.25, 0.0], prompt_len=2, reward=reward, policy_version=step,
        turns=[TurnRecord(gen_start=2, gen_end=4, obs_end=5, reward=reward, action="7",
                          observation="ok", finish_reason="stop")],
        env="arith", env_info={"answer": 7}, worker="w0", engine="hf", created_s=time.time())


async def publish_trajs(bus, job_id, step, rewards):
    for i, r in enumerate(rewards):
        t = traj(job_id, step, i, r)
        await bus.publish(S.job(job_id, "traj"), t, msg_id=t.episode_id)


async def until(sql, data_dir, want, proc, timeout_s=45.0):
    """Poll `sql` until it returns `want` rows; returns the last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = run_query(sql, data_dir)[1]
        if rows == want:
            return rows
        assert proc.poll() is None, "recorder exited"
        assert time.monotonic() < deadline, f"{sql!r} gave {rows}, want {want}"
        await asyncio.sleep(0.3)


def count(job_id):
    return f"SELECT count(*) FROM trajectories WHERE job_id = '{job_id}'"


async def test_records_trajectories_metrics_events_for_query(bus, services, job_id, tmp_path):
    log = tmp_path / "log"
    proc = services.start("recorder", f"data_dir={log}", *FAST)
    await publish_trajs(bus, job_id, 0, [1.0, 0.0, 0.0, 0.0])
    await publish_trajs(bus, job_id, 1, [1.0, 1.0, 0.0, 1.0])
    for step, rm in ((0, 0.25), (1, 0.75)):
        await bus.publish(S.job(job_id, "metrics"), Metrics(
            job_id=job_id, step=step, policy_version=step, values={"reward_mean": rm, "loss": 0.5}))
    # the learner logs step 1 again after resuming: the latest value wins, once
    await bus.publish(S.job(job_id, "metrics"), Metrics(
        job_id=job_id, step=1, policy_version=1, values={"reward_mean": 0.8}))
    for state in (JobState.RUNNING, JobState.COMPLETED):
        await bus.publish(S.job(job_id, "events"), JobStateChanged(
            job_id=job_id, state=state, step=2, time_s=time.time(), source="learner"))

    per_step = (f"SELECT step, avg(reward), count(*) FROM trajectories WHERE job_id = '{job_id}' "
                "GROUP BY step ORDER BY step")
    await until(per_step, log, [(0, 0.25, 4), (1, 0.75, 4)], proc)
    await until(f"SELECT step, value FROM metrics WHERE job_id = '{job_id}' AND key = 'reward_mean' "
                "ORDER BY step", log, [(0, 0.25), (1, 0.8)], proc)
    await until(f"SELECT state FROM events WHERE job_id = '{job_id}' ORDER BY time_s", log,
                [("running",), ("completed",)], proc)

    cols, rows = run_query(
        f"SELECT token_ids, loss_mask, logprobs, turns[1].action, env_info, num_policy_tokens, "
        f"num_turns FROM trajectories WHERE episode_id = '{job_id}-s1-e3'", log)
    assert cols[0] == "token_ids"
    assert rows == [([1, 2, 3, 4, 5], [0, 0, 1, 1, 0], [0.0, 0.0, -0.5, -0.25, 0.0], "7",
                     '{"answer":7}', 2, 1)]
    parts = list((log / "trajectories" / f"job_id={job_id}").glob("part-*.parquet"))
    assert parts and "token_ids" in pq.read_schema(parts[0]).names


def test_views_exist_before_any_file(tmp_path):
    con = connect(tmp_path / "nothing-yet")
    assert con.execute("SELECT count(*) FROM trajectories").fetchone() == (0,)
    assert "reward" in [d[0] for d in con.execute("SELECT * FROM trajectories").description]
    assert run_query("SELECT key, value FROM metrics", tmp_path) == (["key", "value"], [])


async def test_bad_messages_are_dead_lettered_and_recording_goes_on(bus, services, job_id, tmp_path):
    log = tmp_path / "log"
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("recorder")),
                            deliver_policy=DeliverPolicy.NEW)
    proc = services.start("recorder", f"data_dir={log}", *FAST)
    subj = S.job(job_id, "traj")
    await bus.js.publish(subj, b"\xc1 not msgpack")
    # decodes, but claims another job than its subject
    await bus.publish(subj, traj("someone-else", 0, 0, 1.0))
    await publish_trajs(bus, job_id, 0, [1.0, 0.0])
    await until(count(job_id), log, [(2,)], proc)

    recs = [decode(m.data, DeadLetter) for m in await bus.fetch(dlq, 10, 5)]
    assert [r.subject for r in recs] == [subj, subj]
    assert "Trajectory" in recs[0].reason and "does not match subject" in recs[1].reason
    assert run_query("SELECT count(*) FROM trajectories WHERE job_id = 'someone-else'", log)[1] == [(0,)]


async def test_images_are_logged_once_by_hash_and_a_bad_one_is_dead_lettered(bus, services, job_id, tmp_path):
    import hashlib
    import io

    from PIL import Image

    log = tmp_path / "log"
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("recorder")),
                            deliver_policy=DeliverPolicy.NEW)
    proc = services.start("recorder", f"data_dir={log}", *FAST)
    buf = io.BytesIO()
    Image.new("RGB", (20, 10), "red").save(buf, "PNG")
    png = buf.getvalue()
    subj = S.job(job_id, "traj")
    # a group's two episodes show the same diagram (twice in the second): one row of `images`
    for i, imgs in enumerate(([png], [png, png])):
        await bus.publish(subj, msgspec.structs.replace(traj(job_id, 0, i, 1.0), images=imgs))
    # bytes that are no image: the trajectory is logged, the image dead-lettered
    await bus.publish(subj, msgspec.structs.replace(traj(job_id, 0, 2, 0.0), images=[b"not an image"]))
    await until(count(job_id), log, [(3,)], proc)
    h = hashlib.sha256(png).hexdigest()
    await until(f"SELECT sha256, width, height, data = from_hex('{png.hex()}') FROM images "
                f"WHERE job_id = '{job_id}'", log, [(h, 20, 10, True)], proc)
    rows = run_query(f"SELECT episode_id, image_sha256 FROM trajectories WHERE job_id = '{job_id}' "
                     "ORDER BY episode_id", log)[1]
    assert [r[1] for r in rows] == [[h], [h, h], [hashlib.sha256(b"not an image").hexdigest()]]
    recs = [decode(m.data, DeadLetter) for m in await bus.fetch(dlq, 10, 5)]
    assert len(recs) == 1 and recs[0].subject == subj and "image" in recs[0].reason, recs


async def test_restarts_neither_lose_nor_double_rows(bus, services, job_id, tmp_path):
    log = tmp_path / "log"
    # A takes messages but never flushes them (huge batch, long interval), then dies.
    a = services.start("recorder", f"data_dir={log}", "recorder_flush_rows=100000",
                       "recorder_flush_s=600", "recorder_ack_wait_s=3")
    await publish_trajs(bus, job_id, 0, [1.0, 0.0, 1.0, 0.0])
    deadline = time.monotonic() + 45
    while True:
        try:
            info = await bus.js.consumer_info("OT_TRAJ", "recorder-traj")
            if info.num_pending == 0 and info.num_ack_pending >= 4:
                break
        except Exception:  # the consumer may not exist before A's first start
            pass
        assert time.monotonic() < deadline and a.poll() is None
        await asyncio.sleep(0.2)
    a.kill()
    a.wait()
    assert not (log / "trajectories").exists()  # nothing was written, nothing acked

    # B gets the unacked messages again (after the ack wait) and records them.
    b = services.start("recorder", f"data_dir={log}", *FAST)
    await publish_trajs(bus, job_id, 1, [1.0, 1.0])
    await until(count(job_id), log, [(6,)], b)
    b.terminate()
    assert b.wait(30) == 0

    # While no recorder runs, the stream keeps what arrives; C records it.
    await publish_trajs(bus, job_id, 2, [0.0, 1.0, 1.0])
    c = services.start("recorder", f"data_dir={log}", *FAST)
    await until(f"SELECT step, count(*) FROM trajectories WHERE job_id = '{job_id}' GROUP BY step "
                "ORDER BY step", log, [(0, 4), (1, 2), (2, 3)], c)

    # A part written twice (a crash between write and ack) is not counted twice.
    part = next((log / "trajectories" / f"job_id={job_id}").glob("part-*.parquet"))
    shutil.copy(part, part.with_name("part-9999999999999-dup00000.parquet"))
    raw = run_query(f"SELECT count(*) FROM read_parquet('{log}/trajectories/*/*.parquet') "
                    f"WHERE job_id = '{job_id}'", log)[1][0][0]
    assert raw > 9
    assert run_query(count(job_id), log)[1] == [(9,)]
    assert run_query(f"SELECT sum(reward) FROM trajectories WHERE job_id = '{job_id}'", log)[1] == [(6.0,)]



async def test_values_the_columns_cannot_hold_are_dead_lettered_and_recording_goes_on(
        bus, services, job_id, tmp_path):
    """A step of 2**63 (the int64 column), a turn offset of 2**40 (the int32 column):
    each such message is dead-lettered naming the field, every other message of the
    job is recorded, and the recorder keeps running (it once crash-looped on these,
    JetStream redelivering them forever)."""
    log = tmp_path / "log"
    dlq = await bus.durable(S.Durable(S.STREAM_DLQ, f"dlq-{job_id}", S.dead_letter("recorder")),
                            deliver_policy=DeliverPolicy.NEW)
    proc = services.start("recorder", f"data_dir={log}", *FAST)
    metrics, events, trajs = S.job(job_id, "metrics"), S.job(job_id, "events"), S.job(job_id, "traj")
    await bus.publish(metrics, Metrics(job_id=job_id, step=2**63, policy_version=0, values={"loss": 1.0}))
    await bus.publish(events, JobStateChanged(job_id=job_id, state=JobState.RUNNING, step=2**63, source="learner"))
    bad = traj(job_id, 0, 0, 1.0)
    bad = msgspec.structs.replace(bad, turns=[msgspec.structs.replace(bad.turns[0], gen_start=2**40)])
    await bus.publish(trajs, bad)
    await bus.publish(metrics, Metrics(job_id=job_id, step=1, policy_version=1, values={"loss": 0.5}))
    await bus.publish(events, JobStateChanged(job_id=job_id, state=JobState.COMPLETED, step=1, time_s=time.time()))
    await publish_trajs(bus, job_id, 1, [1.0, 0.0])

    await until(f"SELECT step, value FROM metrics WHERE job_id = '{job_id}'", log, [(1, 0.5)], proc)
    await until(f"SELECT state, step FROM events WHERE job_id = '{job_id}'", log, [("completed", 1)], proc)
    await until(f"SELECT step, count(*) FROM trajectories WHERE job_id = '{job_id}' GROUP BY step", log,
                [(1, 2)], proc)
    recs: dict[str, DeadLetter] = {}
    deadline = time.monotonic() + 20
    while len(recs) < 3 and time.monotonic() < deadline:
        for m in await bus.fetch(dlq, 10, 1):
            r = decode(m.data, DeadLetter)
            if job_id in r.subject:
                recs[r.subject] = r
    assert set(recs) == {metrics, events, trajs}
    assert "step" in recs[metrics].reason and "step" in recs[events].reason
    assert "turns.gen_start" in recs[trajs].reason and str(2**40) in recs[trajs].reason, recs[trajs].reason
    await asyncio.sleep(4)  # past the ack wait: a bad message not terminated would come back
    assert proc.poll() is None
    info = await bus.js.consumer_info("OT_TRAJ", "recorder-traj")
    assert info.num_ack_pending == 0
