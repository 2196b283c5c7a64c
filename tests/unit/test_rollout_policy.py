"""The rollout worker's table of weight events (policy.PolicyTracker): which event is a
job's policy, and a request waiting for the version it names. The stream is a stand-in
holding raw messages; the consumer's deliveries are `_note` calls, as in the service."""

import asyncio
from types import SimpleNamespace

import pytest

from opentinker.schemas import WeightsPublished, encode
from opentinker.services.rollout import policy
from opentinker.services.rollout.policy import PolicyTracker, WeightsUnavailable
from opentinker.services.rollout.weights import WeightsError


def event(job_id: str, version: int, run: str = "r1") -> WeightsPublished:
    return WeightsPublished(job_id=job_id, policy_version=version, kind="lora", uri="file:///w",
                            sha256=f"{version:064x}", size_bytes=1, run=run)


class Stream:
    """The part of Bus the tracker reads directly: a job's weight events as stored."""

    def __init__(self):
        self.held: list[SimpleNamespace] = []
        self.reads = 0

    def add(self, ev: WeightsPublished) -> int:
        self.held.append(SimpleNamespace(data=encode(ev), seq=len(self.held) + 1, job_id=ev.job_id))
        return len(self.held)

    async def read_raw(self, subject: str) -> list:
        self.reads += 1
        return [r for r in self.held if subject == f"ot.job.{r.job_id}.weights"]

    async def last_message(self, subject: str):
        self.reads += 1
        mine = [r for r in self.held if subject == f"ot.job.{r.job_id}.weights"]
        return mine[-1] if mine else None


@pytest.fixture
def stream():
    return Stream()


@pytest.fixture
def tracker(stream, tmp_path):
    return PolicyTracker(stream, tmp_path)


async def test_no_event_is_the_base_model(tracker):
    assert await tracker.newest_event("job-a", 0) is None


async def test_a_request_waits_for_the_version_it_names_and_wakes_when_it_is_noted(tracker, stream):
    await tracker._note(event("job-a", 1), stream.add(event("job-a", 1)))
    waiting = asyncio.create_task(tracker.newest_event("job-a", 2))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    reads = stream.reads
    ev = event("job-a", 2)
    await tracker._note(ev, stream.add(ev))  # the ordered consumer's delivery
    assert (await asyncio.wait_for(waiting, 5.0)).policy_version == 2
    assert stream.reads == reads  # woken by the note, not by reading the stream again


async def test_a_version_the_consumer_has_not_delivered_is_read_from_the_stream_once(tracker, stream):
    await tracker._note(event("job-a", 1), stream.add(event("job-a", 1)))
    assert (await tracker.newest_event("job-a", 1)).policy_version == 1
    stream.add(event("job-a", 2))  # stored, not yet delivered
    assert (await tracker.newest_event("job-a", 2)).policy_version == 2
    assert tracker.newest["job-a"][1].policy_version == 2  # the table, the one source


async def test_a_version_that_never_comes_is_unavailable(tracker, stream, monkeypatch):
    monkeypatch.setattr(policy, "WEIGHTS_WAIT_S", 0.1)
    await tracker._note(event("job-a", 1), stream.add(event("job-a", 1)))
    with pytest.raises(WeightsUnavailable, match="policy version 3 was requested.*version 1"):
        await tracker.newest_event("job-a", 3)


async def test_a_request_names_its_run_and_a_resumed_run_re_announces_a_lower_version(tracker, stream):
    stream.add(event("job-a", 5, "r1"))
    resumed = event("job-a", 4, "r2")
    # a restarted worker: its consumer began at the job's last event only
    await tracker._note(resumed, stream.add(resumed))
    assert (await tracker.newest_event("job-a", 0, "r1")).policy_version == 5  # from the stream's history
    assert (await tracker.newest_event("job-a", 0, "r2")).policy_version == 4
    assert (await tracker.newest_event("job-a", 0)).run == "r2"  # the latest announcement, not the highest


def test_a_weight_load_runs_on_one_thread_and_gives_the_threads_back():
    import torch

    before, setter = torch.get_num_threads(), torch.set_num_threads
    # torch's own setter: an in-process vLLM engine (an earlier test's) makes
    # torch.set_num_threads a no-op, and the load must work past that
    torch._C.set_num_threads(2)
    try:
        seen = policy.single_threaded(lambda x: (torch.get_num_threads(), x), "done")
        assert seen == (1, "done")
        assert torch.get_num_threads() == 2
        with pytest.raises(ZeroDivisionError):
            policy.single_threaded(lambda: 1 / 0)
        assert torch.get_num_threads() == 2  # given back after an error too
        torch.set_num_threads = lambda n: None  # as vLLM's CPU worker leaves it
        assert policy.single_threaded(torch.get_num_threads) == 1
    finally:
        torch.set_num_threads = setter
        torch._C.set_num_threads(before)


async def test_an_evaluation_is_served_by_exactly_the_version_it_names(tracker, stream):
    for v in (1, 2, 3):  # versions 2 and 3 came while version 1's evaluation waited
        await tracker._note(event("job-a", v), stream.add(event("job-a", v)))
    assert (await tracker.newest_event("job-a", 1, "r1")).policy_version == 3  # a training group's policy
    assert (await tracker.event_at("job-a", 1, "r1")).policy_version == 1
    assert await tracker.event_at("job-a", 0, "r1") is None  # version 0 never announced: the base model
    waiting = asyncio.create_task(tracker.event_at("job-a", 4, "r1"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    for v in (4, 5):  # 5 noted before the waiter runs: it still gets 4
        await tracker._note(event("job-a", v), stream.add(event("job-a", v)))
    assert (await asyncio.wait_for(waiting, 5.0)).policy_version == 4


async def test_a_pinned_version_noted_before_the_worker_started_is_read_from_the_stream(tracker, stream):
    stream.add(event("job-a", 1))
    stream.add(event("job-a", 1, "r2"))  # a resumed run re-made version 1: the request names its run
    late = event("job-a", 2)
    await tracker._note(late, stream.add(late))
    tracker._looked_up.add("job-a")  # the job's history was read before version 1 was stored
    got = await tracker.event_at("job-a", 1, "r1")
    assert (got.policy_version, got.run) == (1, "r1")


async def test_a_pinned_version_gone_from_the_stream_is_an_error_not_a_newer_policy(tracker, stream, monkeypatch):
    monkeypatch.setattr(policy, "VERSIONS_KEPT", 2)
    for v in (1, 2, 3):
        await tracker._note(event("job-a", v), stream.add(event("job-a", v)))
    stream.held = stream.held[1:]  # the stream's per-job limit dropped version 1's event
    with pytest.raises(WeightsError, match="policy version 1 of learner run 'r1' was requested"):
        await tracker.event_at("job-a", 1, "r1")
