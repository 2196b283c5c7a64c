"""The Tinker wire formats (services/tinker/wire.py), built with the official SDK's own
request and response code: a forward_backward body as the SDK encodes it (dense,
CSR, zstd) decodes to our datums, our ForwardBackwardOutput decodes in the SDK, and
names and paths round-trip while foreign ones are refused."""

import numpy as np
import pytest

from opentinker.schemas.tinker import TinkerResult, TinkerTensor
from opentinker.services.tinker import wire

tinker = pytest.importorskip("tinker")
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402


def body(data, loss_fn="cross_entropy", config=None, forward_only=False, seq_id=3):
    req = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=data, loss_fn=loss_fn,
                                                                 loss_fn_config=config),
        model_id="ts-0123456789:train:2", seq_id=seq_id)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only  # as the SDK's resources/training.py sets it
    return msg.SerializeToString()


def test_a_request_as_the_sdk_encodes_it_decodes_to_our_datums():
    dense = tinker.Datum(model_input=tinker.ModelInput.from_ints([5, 6, 7]),
                         loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 0.5]})
    csr = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2]),
                       loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    req = pb.ForwardBackwardRequest()
    req.ParseFromString(body([dense, csr], "ppo", {"clip_low_threshold": 0.7}, forward_only=True))
    # [2, 4] weights as CSR (the SDK sparsifies 2-D top-K weights so): one 3.0 at [1, 2]
    w = req.data[1].loss_fn_inputs["weights"]
    w.Clear()
    w.dtype, w.shape[:] = pb.DTYPE_FLOAT32, [2, 4]
    w.sparse_csr.values = np.array([3.0], np.float32).tobytes()
    w.sparse_csr.crow_indices = np.array([0, 0, 1], np.int64).tobytes()
    w.sparse_csr.col_indices = np.array([2], np.int64).tobytes()
    sparse = np.zeros((2, 4), np.float32)
    sparse[1, 2] = 3.0
    mid, seq, loss_fn, config, forward_only, data, prov = wire.parse_forward_backward(req.SerializeToString())
    assert (mid, seq, loss_fn, forward_only) == ("ts-0123456789:train:2", 3, "ppo", True)
    assert config == {"clip_low_threshold": pytest.approx(0.7)}
    assert data[0].tokens == [5, 6, 7] and data[1].tokens == [1, 2] and prov == [None, None]
    t = data[0].inputs["target_tokens"]
    assert (t.dtype, t.shape, np.frombuffer(t.data, np.int64).tolist()) == ("int64", [3], [6, 7, 8])
    w = data[1].inputs["weights"]
    assert w.shape == [2, 4] and np.frombuffer(w.data, np.float32).reshape(2, 4).tolist() == sparse.tolist()

    import zstandard

    raw = body([dense])
    assert wire.parse_forward_backward(zstandard.ZstdCompressor().compress(raw), "zstd")[5] == \
        wire.parse_forward_backward(raw)[5]


def test_a_tensor_declaring_a_huge_shape_is_refused_before_anything_is_allocated():
    """Before: a body of a few bytes declaring a sparse [1, 2**33] tensor made the service
    allocate tens of GiB in its event loop (issue 30)."""
    import resource

    req = pb.ForwardBackwardRequest()
    req.ParseFromString(body([tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2]),
                                           loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})]))
    for shape in ([1, 2**33], [2**20, 2**20], [-1, 4], [1] * 9):
        w = req.data[0].loss_fn_inputs["weights"]
        del w.shape[:]
        w.shape.extend(shape)
        w.ClearField("dense")
        w.sparse_csr.values = b""
        w.sparse_csr.crow_indices = np.zeros(2, np.int64).tobytes()
        w.sparse_csr.col_indices = b""
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(wire.WireError, match="over the limit"):
            wire.parse_forward_backward(req.SerializeToString())
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: nothing large made


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.data[0].model_input.add().image.format.__class__, "image"),
    (lambda r: setattr(r, "seq_id", 0), "seq_id"),
    (lambda r: r.data[0].loss_fn_inputs["weights"].__setattr__("dense", b"\x00" * 5), "whole number"),
    (lambda r: r.data[0].loss_fn_inputs["weights"].shape.append(7), "shape"),
])
def test_bad_requests_name_the_field(mutate, match):
    req = pb.ForwardBackwardRequest()
    req.ParseFromString(body([tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2]),
                                           loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})]))
    if match == "image":
        req.data[0].model_input.add().image.data = b"png"
    else:
        mutate(req)
    with pytest.raises(wire.WireError, match=match):
        wire.parse_forward_backward(req.SerializeToString())
    with pytest.raises(wire.WireError, match="ForwardBackwardRequest"):
        wire.parse_forward_backward(b"\xff\xff\xff")
    with pytest.raises(wire.WireError, match="zstd"):
        wire.parse_forward_backward(b"not zstd", "zstd")


def test_our_output_decodes_in_the_sdk():
    lps = [np.array([-1.0, -2.5], np.float32), np.array([-0.5], np.float32)]
    r = TinkerResult(job_id="ts-0123456789-m0", seq_id=1, op="forward",
                     logprobs=[TinkerTensor(dtype="float32", shape=[len(x)], data=x.tobytes()) for x in lps],
                     metrics={"loss:sum": 4.0})
    sdk = deserialize_forward_backward_output(wire.forward_backward_output(r))
    assert [o["logprobs"].to_numpy().tolist() for o in sdk.loss_fn_outputs] == [x.tolist() for x in lps]
    assert sdk.metrics == {"loss:sum": 4.0}


def test_names_round_trip_and_foreign_ones_are_refused():
    sid = wire.new_session_id()
    assert wire.SESSION_RE.match(sid)
    mid = wire.model_id(sid, 3)
    job = wire.job_of_model(mid)
    assert job == f"{sid}-m3" and wire.model_of_job(job) == mid
    assert wire.parse_request_id(wire.request_id(job, 17)) == (job, 17)
    assert wire.parse_save_path(wire.save_path(mid, "weights", "ck-1.a")) == (mid, "weights", "ck-1.a")
    for bad in ("ts-01234:train:0", "ts-0123456789:train:x", "other:train:0", "ts-0123456789:train:0/../x"):
        with pytest.raises(wire.WireError):
            wire.job_of_model(bad)
    for bad in (f"tinker://{mid}/weights/..", f"tinker://{mid}/weights/a/b", f"tinker://{mid}/other/a",
                "s3://bucket/x", f"tinker://{mid}/weights/.hidden"):
        with pytest.raises(wire.WireError):
            wire.parse_save_path(bad)
    with pytest.raises(wire.WireError):
        wire.parse_request_id(f"{job}.1.2")


def test_user_metadata_is_bounded_in_keys_sizes_and_types():
    assert wire.check_metadata(None) == {} and wire.check_metadata({"a": "b", "n": 3, "ok": True}) == {
        "a": "b", "n": "3", "ok": "true"}
    for md, message in (({f"k{i}": "v" for i in range(33)}, "33 keys"),
                        ({"k": "v" * 1025}, "at most 1024 characters"),
                        ({"k" * 129: "v"}, "a key of 1 to 128"),
                        ({"": "v"}, "a key of 1 to 128"),
                        ({"k": {"nested": "x"}}, "a string of at most"),
                        ({"k": ["x"]}, "a string of at most"),
                        ({f"k{i}": "v" * 1000 for i in range(10)}, "over 8192 bytes"),
                        ("a string", "an object of strings"),
                        ([["k", "v"]], "an object of strings")):
        with pytest.raises(wire.WireError, match="^user_metadata"):
            wire.check_metadata(md)
        with pytest.raises(wire.WireError, match=message):
            wire.check_metadata(md)
    assert wire.check_display_name(None) == "" and wire.check_display_name("run a") == "run a"
    for bad in ("x" * 257, 5, ["x"]):
        with pytest.raises(wire.WireError, match="^display_name"):
            wire.check_display_name(bad)


def test_a_saves_ttl_is_a_whole_number_of_seconds_from_an_hour_to_ten_years():
    assert wire.check_ttl(None) == 0
    assert wire.check_ttl(3600) == 3600 and wire.check_ttl(604800) == 604800
    for bad in (-1, 0, 3599, 10 * 365 * 86400 + 1, 2**63, 3600.5, "3600", True):
        with pytest.raises(wire.WireError, match="^ttl_seconds"):
            wire.check_ttl(bad)


def test_top_k_prompt_logprobs_decode_in_the_sdk_with_the_first_row_empty():
    from tinker.proto.response_conv import deserialize_sample_response

    from opentinker.schemas.tinker import TOPK_MASK_LOGPROB, SampledSequence, TinkerSamples

    ids = np.array([[0, 0], [7, 3], [5, 9]], np.int32)
    lps = np.array([[TOPK_MASK_LOGPROB] * 2, [-0.5, -1.25], [-0.125, -3.0]], np.float32)
    r = TinkerSamples(sampler="ts-0123456789-s0", seq_id=1, prompt_logprobs=[float("nan"), -1.25, -0.125],
                      sequences=[SampledSequence(tokens=[1], logprobs=[-0.5], stop_reason="stop")],
                      topk_k=2, topk_ids=ids.tobytes(), topk_logprobs=lps.tobytes())
    got = deserialize_sample_response(wire.sample_response(r))
    assert got.topk_prompt_logprobs == [None, [(7, -0.5), (3, -1.25)], [(5, -0.125), (9, -3.0)]]
    assert deserialize_sample_response(wire.sample_response(
        TinkerSamples(sampler="ts-0123456789-s0", seq_id=1))).topk_prompt_logprobs is None


def test_top_k_sample_logprobs_decode_in_the_sdk_per_sequence():
    from tinker.proto.response_conv import deserialize_sample_response

    from opentinker.schemas.tinker import SampledSequence, TinkerSamples

    ids = np.array([[4, 8], [6, 1]], np.int32)
    lps = np.array([[-0.25, -2.0], [-0.5, -0.75]], np.float32)
    r = TinkerSamples(sampler="ts-0123456789-s0", seq_id=1, sequences=[
        SampledSequence(tokens=[4, 1], logprobs=[-0.25, -0.75], stop_reason="length", topk_k=2,
                        topk_ids=ids.tobytes(), topk_logprobs=lps.tobytes()),
        SampledSequence(tokens=[3], logprobs=[-1.0], stop_reason="stop")])
    a, b = deserialize_sample_response(wire.sample_response(r)).sequences
    assert a.topk_logprobs == [[(4, -0.25), (8, -2.0)], [(6, -0.5), (1, -0.75)]]
    assert b.topk_logprobs is None and b.tokens == [3]
