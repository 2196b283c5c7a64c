"""The learner's rank group (ranks.RankGroup) when a call fails: the error names the
rank and what failed, the call returns instead of hanging (a rank that fails ends the
group; the others may be waiting for it in a collective), and no rank outlives it."""

import os
import stat
import time

import pytest

from opentinker.schemas import JobSpec
from opentinker.services.learner.ranks import RankError, RankGroup


@pytest.mark.timeout(600)
def test_a_failing_call_names_the_rank_and_ends_the_group(tmp_path, tiny_model):
    spec = JobSpec(lora_rank=4, lora_alpha=8, learner_ranks=2)
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    group = RankGroup(spec, tiny_model, "cpu", scratch, threads=1)
    try:
        assert group.world_size == 2 and group.vocab_size > 0
        # the rank-0 connection key is readable by this user only
        assert stat.S_IMODE(os.stat(scratch / "ranks.json").st_mode) == 0o600
        assert len(group.weights_bytes()) > 0
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"load_state failed on rank 0: RuntimeError: no DeepSpeed checkpoint"):
            group.load_state(tmp_path / "nowhere")
        assert time.monotonic() - t0 < 60
        with pytest.raises(RankError):
            group.weights_bytes()  # the group is gone: the next call says so, at once
    finally:
        group.close()
    assert group._proc.poll() is not None  # torchrun, and with it every rank, has exited
