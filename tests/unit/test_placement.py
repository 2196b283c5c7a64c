"""Placement decisions (pure): FIFO, quotas, shared rollout workers, lost workers."""

import msgspec

from opentinker.schemas import JobRecord, JobSpec, JobState
from opentinker.schemas.pool import Placement, WorkerCapacity, WorkerInfo
from opentinker.services.scheduler.placement import Quota, lost_by_job, lost_workers, plan, without_lost_rollout

BIG = Quota(max_jobs=10, max_workers=10)


def worker(wid: str, kind: str, slots: int = 1, engines=(), jobs=(), ranks: int = 1) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, kind=kind,
                      capacity=WorkerCapacity(slots=slots, engines=list(engines), ranks=ranks),
                      jobs=list(jobs), time_s=1.0)


def job(jid: str, t: float, user: str = "a", kind: str = "train", placement=None, **spec) -> JobRecord:
    return JobRecord(job_id=jid, spec=JobSpec(**spec), created_s=t, user=user, kind=kind,
                     placement=placement, state=JobState.RUNNING if placement else JobState.QUEUED,
                     attempt=placement.attempt if placement else 0)


def pool(*ws: WorkerInfo) -> dict[str, WorkerInfo]:
    return {w.worker_id: w for w in ws}


def test_fifo_places_what_fits_and_queues_the_rest():
    live = pool(worker("l1", "learner"), worker("r1", "rollout", slots=4))
    got = plan([job("b", 2.0), job("a", 1.0)], [], live, lambda u: BIG, 5.0)
    assert [(r.job_id, p.learner, p.rollout, p.attempt) for r, p in got] == [("a", "l1", ["r1"], 1)]


def test_a_freed_learner_takes_the_next_queued_job():
    live = pool(worker("l1", "learner"), worker("r1", "rollout", slots=4))
    running = job("a", 1.0, placement=Placement(attempt=1, learner="l1", rollout=["r1"]))
    assert plan([job("b", 2.0)], [running], live, lambda u: BIG, 5.0) == []
    got = plan([job("b", 2.0)], [], live, lambda u: BIG, 5.0)  # a finished
    assert [r.job_id for r, _ in got] == ["b"]


def test_the_first_job_that_does_not_fit_holds_back_later_ones():
    live = pool(*(worker(f"l{i}", "learner") for i in range(3)), worker("r1", "rollout", slots=1),
                worker("r2", "rollout", slots=4))
    busy = job("a", 0.5, placement=Placement(attempt=1, learner="l0", rollout=["r1"]))
    big = job("big", 1.0, rollout_workers=2)   # needs both rollout workers: r1 is full now
    small = job("small", 2.0)
    assert plan([big, small], [busy], live, lambda u: BIG, 5.0) == []


def test_quota_skips_a_user_without_blocking_others():
    live = pool(*(worker(f"l{i}", "learner") for i in range(3)), worker("r1", "rollout", slots=8))
    mine = job("a1", 0.5, user="alice", placement=Placement(attempt=1, learner="l0", rollout=["r1"]))
    quota = {"alice": Quota(max_jobs=1, max_workers=10), "bob": BIG}
    got = plan([job("a2", 1.0, user="alice"), job("b1", 2.0, user="bob")], [mine], live, quota.get, 5.0)
    assert [r.job_id for r, _ in got] == ["b1"]
    # workers quota: a job holding 1 learner + 3 rollout workers exceeds max_workers 3
    live = pool(worker("l1", "learner"), *(worker(f"r{i}", "rollout") for i in range(3)))
    got = plan([job("c", 1.0, user="carol", rollout_workers=3)], [], live,
               lambda u: Quota(max_jobs=5, max_workers=3), 5.0)
    assert got == []


def test_jobs_of_one_base_model_share_a_rollout_worker():
    live = pool(worker("l1", "learner"), worker("l2", "learner"),
                worker("r1", "rollout", slots=4), worker("r2", "rollout", slots=4))
    first = job("a", 1.0, model="m1", placement=Placement(attempt=1, learner="l1", rollout=["r2"]))
    got = plan([job("b", 2.0, model="m1")], [first], live, lambda u: BIG, 5.0)
    assert got[0][1].rollout == ["r2"]   # the worker already serving m1
    got = plan([job("c", 2.0, model="m2")], [first], live, lambda u: BIG, 5.0)
    assert got[0][1].rollout == ["r1"]   # another model: the least loaded worker


def test_inference_jobs_need_no_learner_and_engines_are_respected():
    live = pool(worker("r1", "rollout", engines=["hf"]), worker("r2", "rollout", engines=["vllm", "hf"]))
    got = plan([job("i", 1.0, kind="inference", engine="vllm")], [], live, lambda u: BIG, 5.0)
    assert got[0][1].learner == "" and got[0][1].rollout == ["r2"]
    sft = job("s", 2.0, algorithm="sft", sft_data="x.jsonl")
    got = plan([sft], [], pool(worker("l1", "learner")), lambda u: BIG, 5.0)
    assert got[0][1].rollout == []       # SFT samples nothing


def test_lost_workers_and_a_job_not_yet_let_go():
    p = Placement(attempt=2, learner="l1", rollout=["r1", "r2"])
    rec = job("a", 1.0, placement=p)
    assert lost_workers(rec, pool(worker("l1", "learner"), worker("r1", "rollout"))) == ["r2"]
    # per job: only unfinished jobs that lost a worker
    done = msgspec.structs.replace(rec, job_id="b", state=JobState.COMPLETED)
    whole = job("c", 1.0, placement=Placement(attempt=1, learner="l1", rollout=["r1"]))
    assert lost_by_job([whole, rec, done], pool(worker("l1", "learner"), worker("r1", "rollout"))) == {1: ["r2"]}
    # requeued, but its old learner still reports it: it waits for the learner to let go
    requeued = msgspec.structs.replace(rec, placement=None, state=JobState.QUEUED)
    live = pool(worker("l1", "learner", jobs=["a"]), worker("l2", "learner"), worker("r1", "rollout"))
    assert plan([requeued], [], live, lambda u: BIG, 5.0) == []
    live["l1"] = worker("l1", "learner")
    got = plan([requeued], [], live, lambda u: BIG, 5.0)
    assert got[0][1].attempt == 3


def test_a_training_job_keeps_its_attempt_on_the_rollout_workers_that_survive():
    p = Placement(attempt=2, learner="l1", rollout=["r1", "r2", "r3"], placed_s=4.0)
    rec = job("a", 1.0, placement=p, rollout_workers=3)
    assert without_lost_rollout(rec, ["r2"]) == Placement(attempt=2, learner="l1", rollout=["r1", "r3"],
                                                          placed_s=4.0)
    assert without_lost_rollout(rec, ["r1", "r3"]).rollout == ["r2"]
    # requeued instead: its learner is lost, no rollout worker is left, nothing is lost,
    # an inference job (its endpoint names one worker), a job without a placement
    assert without_lost_rollout(rec, ["l1"]) is None
    assert without_lost_rollout(rec, ["l1", "r2"]) is None
    assert without_lost_rollout(rec, ["r1", "r2", "r3"]) is None
    assert without_lost_rollout(rec, []) is None
    inference = job("i", 1.0, kind="inference", placement=Placement(attempt=1, rollout=["r1", "r2"]))
    assert without_lost_rollout(inference, ["r2"]) is None
    assert without_lost_rollout(job("q", 1.0), ["r1"]) is None


def test_a_job_the_whole_pool_cannot_hold_blocks_no_one():
    """A tenant's job asking for more rollout workers than the pool has (or any train job
    in a pool without a learner) waits forever, but must not stall the FIFO for others."""
    live = pool(worker("l1", "learner"), worker("l2", "learner"), worker("r1", "rollout", slots=4))
    impossible = job("huge", 1.0, user="mallory", rollout_workers=5)
    got = plan([impossible, job("b", 2.0, user="alice")], [], live, lambda u: BIG, 5.0)
    assert [r.job_id for r, _ in got] == ["b"]
    # a job that fits the pool but not its free capacity still holds its place (no starvation)
    busy = job("a", 0.5, placement=Placement(attempt=1, learner="l1", rollout=["r1"]))
    big = job("big", 1.0, user="carol", rollout_workers=1)
    live2 = pool(worker("l1", "learner"), worker("l2", "learner"), worker("r1", "rollout", slots=1))
    assert plan([big, job("c", 2.0, user="dave")], [busy], live2, lambda u: BIG, 5.0) == []


def test_a_data_parallel_job_takes_a_learner_offering_its_ranks():
    live = pool(worker("l1", "learner", ranks=1), worker("l2", "learner", ranks=4),
                worker("r1", "rollout", slots=4))
    got = plan([job("dp", 1.0, learner_ranks=2), job("one", 2.0)], [], live, lambda u: BIG, 5.0)
    assert [(r.job_id, p.learner) for r, p in got] == [("dp", "l2"), ("one", "l1")]
    # the learner offering enough ranks is busy: the job waits, holding the round back
    busy = job("a", 0.5, placement=Placement(attempt=1, learner="l2", rollout=["r1"]))
    got = plan([job("dp", 1.0, learner_ranks=2), job("one", 2.0)], [busy], live, lambda u: BIG, 5.0)
    assert got == []


def test_a_job_wanting_more_ranks_than_any_learner_offers_blocks_no_one():
    live = pool(worker("l1", "learner", ranks=2), worker("r1", "rollout", slots=4))
    got = plan([job("huge", 1.0, learner_ranks=8), job("one", 2.0)], [], live, lambda u: BIG, 5.0)
    assert [r.job_id for r, _ in got] == ["one"]


def test_one_user_with_many_queued_jobs_does_not_keep_another_behind():
    """Issue 30, item 4: FIFO with a break let the head of the queue (one user's burst)
    hold every other user's job back."""
    live = pool(worker("l1", "learner"), worker("l2", "learner"), worker("r1", "rollout", slots=8))
    bobs = [job(f"b{i}", 1.0 + i, user="bob") for i in range(5)]
    alice = job("a", 10.0, user="alice")
    got = plan([*bobs, alice], [], live, lambda u: BIG, 20.0)
    assert sorted(r.job_id for r, _ in got) == ["a", "b0"]  # one each, though bob's five came first


def test_a_user_over_their_learner_share_waits_while_another_user_waits_for_a_learner():
    live = pool(*(worker(f"l{i}", "learner") for i in range(3)),
                *(worker(f"r{i}", "rollout", slots=8) for i in range(4)))
    share = lambda u: Quota(max_jobs=10, max_workers=20, learner_share=0.5)  # noqa: E731
    held = [job("b0", 0.1, user="bob", placement=Placement(attempt=1, learner="l0", rollout=["r0"])),
            # alice's inference jobs hold more workers than bob's one job: fair order alone would pick bob
            job("ai", 0.2, user="alice", kind="inference", rollout_workers=4,
                placement=Placement(attempt=1, rollout=["r0", "r1", "r2", "r3"]))]
    live["l1"] = worker("l1", "learner", jobs=["x"])
    busy = job("x", 0.0, user="carol", placement=Placement(attempt=1, learner="l1", rollout=["r1"]))
    got = plan([job("b1", 1.0, user="bob"), job("a", 2.0, user="alice")], [*held, busy], live, share, 5.0)
    assert [r.job_id for r, _ in got] == ["a"]  # bob holds 1 of 3 learner slots, his share: alice's job first
    # with nobody else waiting, bob may use every free learner
    got = plan([job("b1", 1.0, user="bob")], [*held, busy], live, share, 5.0)
    assert [r.job_id for r, _ in got] == ["b1"]
