"""Which finished job records the scheduler deletes (scheduler/retention.py) and the
settings that bound them."""

from __future__ import annotations

import msgspec

from opentinker.schemas import JobRecord, JobSpec, JobState
from opentinker.services.core.config import Settings, load_settings
from opentinker.services.scheduler.retention import DAY_S, expired_records, named_jobs

NOW = 1_800_000_000.0
FINISHED = (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)
UNFINISHED = tuple(s for s in JobState if not s.terminal)


def rec(job_id: str, user: str = "bob", state: JobState = JobState.CANCELLED, age_days: float = 0.0,
        **spec) -> JobRecord:
    t = NOW - age_days * DAY_S
    return JobRecord(job_id=job_id, spec=JobSpec(**spec), state=state, user=user, created_s=t - 10, updated_s=t)


def ids(recs: list[JobRecord]) -> list[str]:
    return [r.job_id for r in recs]


def test_finished_records_older_than_the_retention_go_and_unfinished_ones_never():
    recs = [rec("old-done", state=JobState.COMPLETED, age_days=31),
            rec("old-failed", state=JobState.FAILED, age_days=40),
            rec("old-cancelled", age_days=30.01), rec("young", state=JobState.COMPLETED, age_days=29.9),
            *(rec(f"old-{s.value}", state=s, age_days=400) for s in UNFINISHED)]
    assert UNFINISHED  # queued and running
    assert ids(expired_records(recs, NOW, 30, 200)) == ["old-failed", "old-done", "old-cancelled"]  # oldest first
    assert expired_records(recs, NOW, 0, 0) == []  # both 0: no limit


def test_only_the_newest_finished_records_of_each_user_stay():
    bob = [rec(f"bob-{i}", age_days=i / 100, state=FINISHED[i % 3]) for i in range(15)]  # bob-0 newest
    alice = [rec(f"alice-{i}", user="alice", age_days=i / 100) for i in range(4)]
    running = [rec(f"bob-run-{i}", state=JobState.RUNNING, age_days=50) for i in range(3)]
    gone = expired_records([*bob, *alice, *running], NOW, 30, 10)
    assert ids(gone) == [f"bob-{i}" for i in range(14, 9, -1)]  # the 5 oldest of bob's, oldest first
    assert set(ids(expired_records([*bob, *alice, *running], NOW, 30, 2))) == \
        {*(f"bob-{i}" for i in range(2, 15)), "alice-2", "alice-3"}
    # unfinished jobs neither count toward the limit nor are ever named
    assert not set(ids(expired_records(running, NOW, 30, 1)))


def test_a_finished_job_an_unfinished_one_names_stays():
    source = rec("src", age_days=90, state=JobState.COMPLETED)
    rival = rec("rival", age_days=90, state=JobState.COMPLETED)
    user = rec("user-job", state=JobState.QUEUED, algorithm="tinker", tinker_init="src/step-8")
    seats = rec("seats", state=JobState.RUNNING, agents=2, opponents={"o": "rival"})
    sft = rec("sft", age_days=90, state=JobState.COMPLETED, algorithm="sft", sft_data="d.jsonl")
    rl = rec("rl", state=JobState.RUNNING, init_from="sft")  # an RL stage starting from the SFT job
    assert named_jobs([source, rival, user, seats, sft, rl]) == {"src", "rival", "sft"}
    assert expired_records([source, rival, user, seats, sft, rl], NOW, 30, 200) == []
    # a finished one naming them protects nothing; `in_use` (other pools' jobs) does
    done = msgspec.structs.replace(user, state=JobState.CANCELLED)
    assert set(ids(expired_records([source, rival, done], NOW, 30, 200))) == {"src", "rival"}
    assert ids(expired_records([source, rival, done], NOW, 30, 200, in_use={"src"})) == ["rival"]


def test_the_retention_settings_and_their_environment_variables(monkeypatch):
    s = Settings()
    assert (s.job_retention_days, s.finished_jobs_per_user) == (30.0, 200)
    monkeypatch.setenv("OPENTINKER_JOB_RETENTION_DAYS", "0.5")
    monkeypatch.setenv("OPENTINKER_FINISHED_JOBS_PER_USER", "10")
    s = load_settings()
    assert (s.job_retention_days, s.finished_jobs_per_user) == (0.5, 10)
