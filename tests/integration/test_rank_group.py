"""The learner's rank group (ranks.RankGroup) when a call fails: the error names the
rank and what failed, the call returns instead of hanging (a rank that fails ends the
group; the others may be waiting for it in a collective), and no rank outlives it. The
ranks listen on loopback only."""

import os
import signal
import stat
import time

import psutil
import pytest

from opentinker.schemas import JobSpec
from opentinker.services.learner.ranks import RankError, RankGroup

from conftest import listeners


def _start(tmp_path, tiny_model) -> RankGroup:
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    return RankGroup(JobSpec(lora_rank=4, lora_alpha=8, learner_ranks=2), tiny_model, "cpu", scratch, threads=1)


@pytest.mark.timeout(600)
def test_a_failing_call_names_the_rank_and_ends_the_group(tmp_path, tiny_model):
    group = _start(tmp_path, tiny_model)
    try:
        assert group.world_size == 2 and group.vocab_size > 0
        # the rank-0 connection key is readable by this user only
        assert stat.S_IMODE(os.stat(tmp_path / "scratch" / "ranks.json").st_mode) == 0o600
        assert len(group.weights_bytes()) > 0
        # the ranks are this service's only processes, and listen on loopback alone (gloo's
        # pairs); torchrun's rendezvous store listened on every interface, unauthenticated
        pids = [p.pid for p in group._procs]
        assert {c.pid for c in psutil.Process().children(recursive=True)} >= set(pids)
        listening = [s for pid in pids for s in listeners(pid)]
        assert listening and all(loopback for *_, loopback in listening), listening
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"load_state failed on rank 0: RuntimeError: no DeepSpeed checkpoint"):
            group.load_state(tmp_path / "nowhere")
        assert time.monotonic() - t0 < 60
        with pytest.raises(RankError):
            group.weights_bytes()  # the group is gone: the next call says so, at once
    finally:
        group.close()
    assert all(p.poll() is not None for p in group._procs)  # every rank has exited


@pytest.mark.timeout(600)
def test_a_rank_that_dies_ends_the_call_in_flight_and_the_group(tmp_path, tiny_model):
    group = _start(tmp_path, tiny_model)
    try:
        os.kill(group._procs[1].pid, signal.SIGKILL)  # rank 0 will wait for it in the next collective
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"rank 1 exit -9"):
            group.weights_bytes()
        assert time.monotonic() - t0 < 30
        assert all(p.poll() is not None for p in group._procs)  # rank 0 did not outlive it
    finally:
        group.close()
