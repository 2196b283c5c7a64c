"""DAPO's dynamic sampling (arXiv 2503.14476 §3.2): a replaced group gets a fresh prompt
whose seed is a pure function of the job seed, step, group and replacement index; the
spec field is bounded. The replacement itself runs through the services in
tests/integration/test_objective_jobs.py ("dynamic")."""

import msgspec
import pytest

from opentinker.schemas import JobSpec
from opentinker.schemas.job import spec_from_dict
from opentinker.services.learner.job import group_seed


def test_a_replacement_asks_a_new_prompt_reproducibly():
    first = group_seed(0, 3, 1)
    assert group_seed(0, 3, 1, 0) == first  # no replacement: the seed every run used so far
    refills = [group_seed(0, 3, 1, r) for r in range(1, 6)]
    assert len({first, *refills}) == 6  # each replacement a different prompt
    assert refills == [group_seed(0, 3, 1, r) for r in range(1, 6)]  # and the same on every run
    # not another group's or step's first prompt
    assert not set(refills) & {group_seed(0, s, i) for s in range(10) for i in range(10)}


def test_dynamic_sampling_is_off_by_default_and_bounded():
    assert JobSpec().dynamic_sampling == 0
    assert spec_from_dict({"dynamic_sampling": 4}).dynamic_sampling == 4
    with pytest.raises((msgspec.ValidationError, ValueError), match="dynamic_sampling"):
        spec_from_dict({"dynamic_sampling": -1})
