"""The REST API's sampling body (services/scheduler/api.py, pydantic, for its OpenAPI
schema) restates SamplingParams (schemas/job.py): the same fields with the same
defaults, so that an inference plan the SDK sends over REST is what the bus takes."""

import msgspec
import pytest

pytest.importorskip("fastapi")

from opentinker.schemas import SamplingParams  # noqa: E402
from opentinker.services.scheduler.api import SamplingBody  # noqa: E402


def test_the_rest_sampling_body_has_the_fields_and_defaults_of_sampling_params():
    assert SamplingBody().model_dump() == msgspec.to_builtins(SamplingParams())
