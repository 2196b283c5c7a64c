"""Schema round-trips and job spec validation (no server)."""

import msgspec
import pytest

from opentinker.schemas import (
    DeadLetter, EnvStepReply, JobSpec, JobStateChanged, JobState, Metrics, RolloutRequest,
    SubmitJob, Trajectory, TurnRecord, WeightsPublished, decode, encode,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.job import SpecError, spec_from_dict


def _traj() -> Trajectory:
    return Trajectory(
        job_id="j1", request_id="r1", episode_id="e1", step=3, group_index=0, group_size=8,
        token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 0], logprobs=[0.0, 0.0, -0.5, -1.25, 0.0],
        prompt_len=2, turns=[TurnRecord(gen_start=2, gen_end=4, obs_end=5, reward=1.0, policy_version=2)],
        reward=1.0, policy_version=2, env_info={"answer": 7},
    )


@pytest.mark.parametrize("msg", [
    _traj(),
    SubmitJob(spec=JobSpec(env="gsm8k", lora_rank=0)),
    JobStateChanged(job_id="j1", state=JobState.RUNNING, step=4),
    Metrics(job_id="j1", step=1, policy_version=1, values={"reward_mean": 0.5}),
    RolloutRequest(job_id="j1", request_id="r", step=0, group_index=1, group_seed=9,
                   policy_version=0, model="m", env="arith"),
    WeightsPublished(job_id="j1", policy_version=3, kind="lora", uri="nats-os://b/o", sha256="ab",
                     size_bytes=10),
    EnvStepReply(observation="o", reward=1.0, done=False),
    DeadLetter(service="s", subject="x", reason="bad", payload=b"\x00\x01"),
])
def test_round_trip(msg):
    assert decode(encode(msg), type(msg)) == msg


def test_decode_names_bad_field():
    bad = msgspec.msgpack.encode({"job_id": "j", "step": "three"})
    with pytest.raises(msgspec.ValidationError, match="step"):
        decode(bad, Metrics)


def test_spec_errors_name_the_field():
    with pytest.raises(SpecError) as e:
        spec_from_dict({"group_size": 1})
    assert e.value.field == "group_size"
    with pytest.raises(SpecError) as e:
        spec_from_dict({"lr": "fast"})
    assert e.value.field == "lr"
    with pytest.raises(SpecError) as e:
        spec_from_dict({"sampling": {"top_p": 0}})
    assert e.value.field == "sampling.top_p"
    with pytest.raises(SpecError) as e:
        spec_from_dict({"learning_rate": 0.1})
    assert "learning_rate" in e.value.field


def test_job_ids_cannot_forge_subjects():
    assert S.job("abc-1", "traj") == "ot.job.abc-1.traj"
    for bad in ("a.b", "a*", "A", "x>", "", "a b"):
        with pytest.raises(ValueError):
            S.job(bad, "traj")


# packages whose modules need an optional dependency this suite does not install
_OPTIONAL = ("opentinker.environment.android_world",)


def _structs(*packages: str) -> list[type]:
    """Every msgspec Struct the modules of `packages` (and their subpackages) define (a
    module's own, not its imports); not `__main__`s, nor the _OPTIONAL packages."""
    import importlib
    import pkgutil

    found = []
    for name in packages:
        pkg = importlib.import_module(name)
        for mod in pkgutil.walk_packages(pkg.__path__, f"{name}.",
                                         onerror=lambda n: None if n.startswith(_OPTIONAL) else pytest.fail(n)):
            if mod.name.rsplit(".", 1)[-1] == "__main__" or mod.name.startswith(_OPTIONAL):
                continue
            module = importlib.import_module(mod.name)
            found += [v for v in vars(module).values()
                      if isinstance(v, type) and issubclass(v, msgspec.Struct) and v.__module__ == mod.name]
    return found


def _assert_decoders(structs: list[type]) -> None:
    for kind in structs:
        msgspec.msgpack.Decoder(kind)
        msgspec.json.Decoder(kind)


def test_every_schema_struct_gets_a_decoder():
    """msgspec checks a type's constraints when a decoder is built, not when the module
    is imported: a bound it cannot hold (an integer bound outside int64, such as
    `lt=2**63`) raised only at the first decode of that message, inside a service."""
    structs = _structs("opentinker.schemas")
    assert len(structs) > 30
    _assert_decoders(structs)


def test_every_struct_of_the_package_gets_a_decoder():
    """The same check for the Structs the services, SDK and CLI define (the Tinker API's
    request bodies and run records, the settings file, the simulated user's scenarios):
    every module of the package imported (not its `__main__`s), every Struct defined
    there given a msgpack and a JSON decoder."""
    found = _structs("opentinker.services", "opentinker.sdk", "opentinker.cli", "opentinker.client",
                     "opentinker.environment", "opentinker.ops")
    assert len(found) > 15, found
    _assert_decoders(found)
