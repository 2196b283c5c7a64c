"""The Tinker REST listing's pure parts (services/tinker/runs.py): a list's page and
scope are bounded and a bad one names its field, object names map to checkpoints and
back (another kind of object, or a forged name, maps to none), and what the routes
answer parses as the official SDK's own types."""

from datetime import datetime, timezone

import msgspec
import pytest

from opentinker.schemas import JobRecord, JobSpec
from opentinker.schemas import subjects as S
from opentinker.services.tinker import runs, wire
from opentinker.services.tinker.sessions import LORA_MODULES

tinker = pytest.importorskip("tinker")

JOB = "ts-0123456789-m2"
MID = "ts-0123456789:train:2"


def test_a_page_takes_its_defaults_and_refuses_what_is_out_of_bounds_naming_the_field():
    assert runs.page({}, 20) == (20, 0)
    assert runs.page({"limit": "5", "offset": "10"}, 20) == (5, 10)
    assert runs.page({"limit": str(runs.MAX_PAGE), "offset": str(runs.MAX_OFFSET)}, 20) == (runs.MAX_PAGE,
                                                                                          runs.MAX_OFFSET)
    for query, field in (({"limit": "0"}, "limit"), ({"limit": str(runs.MAX_PAGE + 1)}, "limit"),
                         ({"limit": "-3"}, "limit"), ({"limit": "2.5"}, "limit"), ({"limit": "1_000"}, "limit"),
                         ({"limit": "٣"}, "limit"), ({"limit": ""}, "limit"), ({"offset": "-1"}, "offset"),
                         ({"offset": "9" * 40}, "offset"), ({"offset": str(runs.MAX_OFFSET + 1)}, "offset")):
        with pytest.raises(wire.WireError, match=f"^{field}: "):
            runs.page(query, 20)


def test_a_run_query_may_ask_for_its_own_runs_only():
    runs.check_scope({})
    runs.check_scope({"access_scope": "owned"})
    runs.check_scope({"access_scope": "accessible"})
    with pytest.raises(wire.WireError, match="^access_scope: "):
        runs.check_scope({"access_scope": "all"})
    with pytest.raises(wire.WireError, match="^project_id: "):
        runs.check_scope({"project_id": "p"})


def test_object_names_map_to_checkpoints_and_back():
    assert runs.checkpoint_of_object(S.OBJ_CHECKPOINTS, f"{JOB}/named/ckpt-a") == (JOB, "weights", "ckpt-a")
    assert runs.checkpoint_of_object(S.OBJ_WEIGHTS, f"{JOB}/sampler/sampler-0") == (JOB, "sampler_weights",
                                                                                    "sampler-0")
    for bucket, name in ((S.OBJ_CHECKPOINTS, f"{JOB}/latest"), (S.OBJ_WEIGHTS, f"{JOB}/v3"),
                         (S.OBJ_WEIGHTS, f"{JOB}/named/ckpt-a"), (S.OBJ_CHECKPOINTS, f"{JOB}/sampler/x"),
                         (S.OBJ_CHECKPOINTS, "grpo-job/named/ckpt-a"), (S.OBJ_CHECKPOINTS, f"{JOB}/named/../x"),
                         (S.OBJ_CHECKPOINTS, f"{JOB}/named/a/b")):
        assert runs.checkpoint_of_object(bucket, name) is None, name
    assert runs.object_of_checkpoint(JOB, "weights/ckpt-a") == (S.OBJ_CHECKPOINTS, f"{JOB}/named/ckpt-a")
    assert runs.object_of_checkpoint(JOB, "sampler_weights/s") == (S.OBJ_WEIGHTS, f"{JOB}/sampler/s")
    for bad in ("weights", "weights/", "weights/../x", "weights/a/b", "named/ckpt-a", "external_weights/x", ""):
        with pytest.raises(wire.WireError, match="^checkpoint_id: "):
            runs.object_of_checkpoint(JOB, bad)


def test_an_object_time_is_read_as_utc_and_a_missing_one_as_the_epoch():
    assert runs.utc("2026-11-28T14:50:57.123456+00:00") == datetime(2026, 11, 28, 14, 50, 57, 123456, timezone.utc)
    assert runs.utc("2026-11-28T16:50:57+02:00") == datetime(2026, 11, 28, 14, 50, 57, tzinfo=timezone.utc)
    assert runs.utc("2026-11-28T14:50:57.123456789Z").tzinfo == timezone.utc  # Go's RFC 3339 nanoseconds
    assert runs.utc("2026-11-28T14:50:57") == datetime(2026, 11, 28, 14, 50, 57, tzinfo=timezone.utc)
    assert runs.utc("") == runs.utc(None) == runs.utc("garbage") == datetime.fromtimestamp(0, timezone.utc)


def test_what_the_routes_answer_parses_as_the_sdks_own_types():
    spec = JobSpec(algorithm="tinker", model="/models/smollm2", lora_rank=8, lora_alpha=32,
                   lora_target_modules=LORA_MODULES["attn"])
    rec = JobRecord(job_id=JOB, spec=spec, user="alice", created_s=1_700_000_000.0)
    training = runs.checkpoint(JOB, "weights", "a", 1234, "2026-11-28T14:00:00+00:00")
    sampler = runs.checkpoint(JOB, "sampler_weights", "s", 99, "2026-11-28T15:00:00+00:00")
    run = runs.training_run(rec, [sampler, training], active_s=1_800_000_000.0)
    got = tinker.types.TrainingRun.model_validate(msgspec.to_builtins(run))
    assert (got.training_run_id, got.base_model, got.model_owner, got.is_lora, got.lora_rank) == (
        MID, "/models/smollm2", "alice", True, 8)
    assert got.last_request_time == datetime.fromtimestamp(1_800_000_000.0, timezone.utc)
    assert got.last_checkpoint.tinker_path == f"tinker://{MID}/weights/a"
    assert got.last_sampler_checkpoint.checkpoint_type == "sampler"
    parsed = tinker.types.ParsedCheckpointTinkerPath.from_tinker_path(got.last_sampler_checkpoint.tinker_path)
    assert (parsed.training_run_id, parsed.checkpoint_id) == (MID, got.last_sampler_checkpoint.checkpoint_id)
    # a run with no checkpoint, its last request its creation
    bare = tinker.types.TrainingRun.model_validate(msgspec.to_builtins(runs.training_run(rec, [])))
    assert bare.last_checkpoint is None and bare.last_request_time.timestamp() == 1_700_000_000.0
    listing = msgspec.to_builtins({"checkpoints": [sampler, training],
                                   "cursor": runs.Cursor(offset=0, limit=100, total_count=2)})
    assert tinker.types.CheckpointsListResponse.model_validate(listing).checkpoints[1].size_bytes == 1234
    info = tinker.types.WeightsInfoResponse.model_validate(runs.weights_info(rec))
    assert (info.base_model, info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (
        "/models/smollm2", 8, True, False, False)


def test_a_saves_expiry_and_metadata_and_a_runs_metadata_parse_as_the_sdks_types():
    from opentinker.schemas.tinker import TinkerCheckpointMeta, TinkerRunMeta

    meta = TinkerCheckpointMeta(job_id=JOB, user="alice", kind="weights", name="a.b..c", expires_s=1_800_000_000.0,
                                user_metadata={"step": "2"})
    c = runs.checkpoint(JOB, "weights", "a.b..c", 10, "2026-11-25T10:00:00", meta)
    got = tinker.types.Checkpoint.model_validate(msgspec.to_builtins(c))
    assert got.user_metadata == {"step": "2"} and got.expires_at.timestamp() == 1_800_000_000.0
    bare = tinker.types.Checkpoint.model_validate(msgspec.to_builtins(runs.checkpoint(JOB, "weights", "x", 1, None)))
    assert bare.user_metadata is None and bare.expires_at is None
    rec = JobRecord(job_id=JOB, user="alice", spec=JobSpec(algorithm="tinker"), created_s=1.0)
    run = runs.training_run(rec, [c], 0.0, TinkerRunMeta(job_id=JOB, user="alice", user_metadata={"r": "x"}))
    assert tinker.types.TrainingRun.model_validate(msgspec.to_builtins(run)).user_metadata == {"r": "x"}
    # a save name's dots cannot run together in a KV key: the name is in hex there
    assert runs.checkpoint_key(JOB, "weights", "a.b..c") == f"ckpt.{JOB}.weights.{b'a.b..c'.hex()}"
