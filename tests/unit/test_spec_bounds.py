"""Every number and size of a job spec is bounded: a spec a tenant could use to make a
service allocate without limit is refused at submit, naming the field and the range."""

import math

import msgspec
import pytest

from opentinker.schemas.job import SpecError, spec_from_dict, validate_job_spec

# (field, highest accepted, lowest refused above it); dotted = a sampling field
UPPER = [
    ("steps", 1_000_000, 1_000_001),
    ("prompts_per_step", 1024, 1025),
    ("group_size", 256, 257),
    ("max_staleness", 16, 17),
    ("lora_rank", 512, 513),
    ("lora_alpha", 4096, 4097),
    ("micro_batch_size", 4096, 4097),
    ("eval_episodes", 10_000, 10_001),
    ("eval_every", 1_000_000, 1_000_001),
    ("checkpoint_every", 1_000_000, 1_000_001),
    ("sft_batch_size", 4096, 4097),
    ("rollout_workers", 64, 65),
    ("agents", 8, 9),
    ("seed", 2**63 - 1, 2**63),
    ("kl_coef", 100.0, 100.5),
    ("weight_decay", 1.0, 1.5),
    ("max_grad_norm", 1e6, 2e6),
    ("eval_temperature", 10.0, 10.5),
    ("rollout_timeout_s", 86_400.0, 86_401.0),
    ("sampling.max_new_tokens", 32_768, 32_769),
    ("sampling.max_total_tokens", 131_072, 131_073),
    ("sampling.max_turns", 1024, 1025),
    ("sampling.temperature", 10.0, 10.5),
]

# fields whose lower end is new (or newly open)
LOWER = [
    ("seed", 0, -1),
    ("weight_decay", 0.0, -0.1),
    ("max_grad_norm", 1e-6, 0.0),
    ("rollout_timeout_s", 0.1, 0.0),
    ("lora_alpha", 1, 0),
]

FLOATS = ["lr", "weight_decay", "max_grad_norm", "kl_coef", "clip_range", "turn_discount",
          "eval_temperature", "rollout_timeout_s", "sampling.temperature", "sampling.top_p"]


def spec(field: str, value, **extra) -> dict:
    """A spec dict with `field` (dotted for sampling) set to `value`."""
    data: dict = dict(extra)
    if field.startswith("sampling."):
        data.setdefault("sampling", {})[field.split(".", 1)[1]] = value
        if field == "sampling.max_new_tokens":
            data["sampling"]["max_total_tokens"] = 131_072
    else:
        data[field] = value
    return data


def refused(data: dict, kind: str = "train") -> SpecError:
    with pytest.raises(SpecError) as e:
        spec_from_dict(data, kind)
    return e.value


@pytest.mark.parametrize(("field", "ok", "bad"), UPPER)
def test_every_number_has_an_upper_bound(field, ok, bad):
    spec_from_dict(spec(field, ok))
    e = refused(spec(field, bad))
    assert e.field == field
    assert "must be in" in e.reason and str(bad) in e.reason


@pytest.mark.parametrize(("field", "ok", "bad"), LOWER)
def test_lower_bounds(field, ok, bad):
    spec_from_dict(spec(field, ok))
    assert refused(spec(field, bad)).field == field


@pytest.mark.parametrize("field", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_are_refused(field, value):
    e = refused(spec(field, value))
    assert e.field == field and "finite" in e.reason


def test_string_and_list_sizes():
    spec_from_dict({"name": "n" * 200, "model": "m" * 1024, "lora_target_modules": ["x" * 100] * 64})
    assert refused({"name": "n" * 201}).field == "name"
    assert refused({"model": "m" * 1025}).field == "model"
    assert refused({"lora_target_modules": ["q_proj"] * 65}).field == "lora_target_modules"
    assert refused({"lora_target_modules": ["x" * 101]}).field == "lora_target_modules"
    sft = {"algorithm": "sft"}
    spec_from_dict({**sft, "sft_data": "d" * 1024})
    assert refused({**sft, "sft_data": "d" * 1025}).field == "sft_data"
    spec_from_dict({**sft, "sft_query": "s" * 65_536})
    e = refused({**sft, "sft_query": "s" * 65_537})
    assert e.field == "sft_query" and "65536" in e.reason


def test_env_args_are_bounded_encoded():
    blob = "a" * 65_000  # msgpack str header: 5 bytes; key and map header: a few more
    spec_from_dict({"env_args": {"k": blob}})
    e = refused({"env_args": {"k": blob, "k2": "b" * 1000}})
    assert e.field == "env_args" and "65536" in e.reason


def test_max_total_tokens_still_exceeds_max_new_tokens():
    assert refused({"sampling": {"max_new_tokens": 64, "max_total_tokens": 64}}).field == "sampling.max_total_tokens"


def test_top_p_below_one_is_refused_for_training_only():
    e = refused({"sampling": {"top_p": 0.9}})
    assert e.field == "sampling.top_p" and "nucleus" in e.reason
    assert refused({"sampling": {"top_p": 0.9}}, "train").field == "sampling.top_p"
    assert spec_from_dict({"sampling": {"top_p": 0.9}}, "inference").sampling.top_p == 0.9
    # an SFT job does not sample: its top_p is never used for a loss
    spec_from_dict({"algorithm": "sft", "sft_data": "d.jsonl", "sampling": {"top_p": 0.9}})
    # (0, 1] for everyone
    assert refused({"sampling": {"top_p": 0}}, "inference").field == "sampling.top_p"
    assert refused({"sampling": {"top_p": 1.5}}, "inference").field == "sampling.top_p"
    with pytest.raises(ValueError, match="kind"):
        spec_from_dict({}, "serve")


def test_top_k_is_refused_for_training_only():
    e = refused({"sampling": {"top_k": 20}})
    assert e.field == "sampling.top_k" and "top k" in e.reason
    assert spec_from_dict({"sampling": {"top_k": 20}}, "inference").sampling.top_k == 20
    assert spec_from_dict({"sampling": {"top_k": 0}}).sampling.top_k == 0  # 0 and -1: every token
    assert refused({"sampling": {"top_k": -2}}, "inference").field == "sampling.top_k"


def test_data_parallel_ranks_are_for_grpo_jobs():
    assert spec_from_dict({"learner_ranks": 2}).learner_ranks == 2
    e = refused({"algorithm": "sft", "sft_data": "d.jsonl", "learner_ranks": 2})
    assert e.field == "learner_ranks" and "one rank" in e.reason
    assert refused({"learner_ranks": 65}).field == "learner_ranks"


def test_self_play_seats_are_for_grpo_jobs():
    s = spec_from_dict({"agents": 2, "group_size": 4, "prompts_per_step": 3})
    assert s.group_trajectories == 8 and s.episodes_per_step == 24
    e = refused({"algorithm": "sft", "sft_data": "d.jsonl", "agents": 2})
    assert e.field == "agents" and "GRPO" in e.reason
    assert refused({"agents": 0}).field == "agents"
    # opponents: at most agents - 1 seats, seat names and job ids checked
    s = spec_from_dict({"agents": 2, "opponents": {"white": "champ-1"}})
    assert s.opponents == {"white": "champ-1"}
    assert "agents - 1" in refused({"agents": 2, "opponents": {"black": "a", "white": "b"}}).reason
    assert refused({"opponents": {"white": "champ"}}).field == "opponents"  # agents = 1
    assert "not a job id" in refused({"agents": 2, "opponents": {"white": "../x"}}).reason
    assert "must match" in refused({"agents": 2, "opponents": {"w" * 65: "champ"}}).reason


def test_validate_job_spec_takes_the_kind():
    s = msgspec.convert({"sampling": {"top_p": 0.5}}, type(spec_from_dict({})))
    assert validate_job_spec(s, "inference") is s
    with pytest.raises(SpecError):
        validate_job_spec(s)


def test_the_defaults_and_examples_pass():
    import tomllib
    from pathlib import Path

    spec_from_dict({})
    for f in sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml")):
        spec_from_dict(tomllib.loads(f.read_text()))


def test_sampler_dtype_is_one_of_three_and_auto_follows_the_device():
    from opentinker.services.core.models import resolve_sampler_dtype

    assert spec_from_dict({"sampler_dtype": "bfloat16"}).sampler_dtype == "bfloat16"
    e = refused({"sampler_dtype": "float16"})
    assert e.field == "sampler_dtype"
    assert [resolve_sampler_dtype(d, "cpu") for d in ("auto", "float32", "bfloat16")] == \
        ["float32", "float32", "bfloat16"]
    assert [resolve_sampler_dtype(d, "cuda") for d in ("auto", "float32", "bfloat16")] == \
        ["bfloat16", "float32", "bfloat16"]


@pytest.mark.parametrize("amx", [True, False])
def test_dtype_auto_is_bfloat16_only_where_the_device_computes_it_and_a_cpu_sampler_follows(amx, monkeypatch):
    """`dtype = "auto"`: bfloat16 on a CPU with AMX, float32 on one without (emulated
    bfloat16 is many times slower there). A CPU sampler's "auto" follows the learner:
    bfloat16 only for a learner that resolves to bfloat16 on a CPU that has AMX."""
    import torch

    from opentinker.services.core.models import native_bf16, resolve_dtype, resolve_sampler_dtype

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert native_bf16("cpu") is amx
    assert spec_from_dict({"dtype": "auto"}).dtype == "auto"
    assert refused({"dtype": "float16"}).field == "dtype"
    with pytest.raises(ValueError, match="`dtype` must be 'auto', 'float32' or 'bfloat16', got 'fp8'"):
        resolve_dtype("fp8", "cpu")
    native = "bfloat16" if amx else "float32"
    assert [resolve_dtype(d, "cpu") for d in ("auto", "float32", "bfloat16")] == [native, "float32", "bfloat16"]
    assert [resolve_sampler_dtype("auto", "cpu", d) for d in ("auto", "float32", "bfloat16")] == \
        [native, "float32", native]
    # an explicit sampler precision is kept, whatever the learner's
    assert resolve_sampler_dtype("float32", "cpu", "bfloat16") == "float32"
    assert resolve_sampler_dtype("bfloat16", "cpu", "float32") == "bfloat16"
    assert resolve_sampler_dtype("auto", "cuda", "float32") == "bfloat16"


def test_init_from_names_a_job_for_a_grpo_or_sft_job_only():
    assert spec_from_dict({"init_from": "sft-1a2b"}).init_from == "sft-1a2b"
    assert spec_from_dict({"algorithm": "sft", "sft_data": "d.jsonl", "init_from": "sft-1a2b"}).init_from
    for bad in ({"init_from": "../etc"}, {"init_from": "Job_1"},
                {"algorithm": "tinker", "init_from": "sft-1a2b"}):
        e = refused(bad)
        assert e.field == "init_from" and "job id of yours" in e.reason, e
