"""Datum provenance for stable_reinforce (services/tinker/provenance.py), on requests the
official SDK encodes: the datums the cookbook builds (rl_loop's one sequence, a
multi-turn episode's several) pass and get the sampler's logprobs as recorded, not the
client's; every forged, foreign, missing, miscounted or mismatched run is refused,
naming the datum and the run."""

import numpy as np
import pytest

from opentinker.services.tinker import provenance, wire
from opentinker.services.tinker.provenance import Recorded

tinker = pytest.importorskip("tinker")
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

SESSION = "ts-0123456789"
OTHER = "ts-abcdefabcd"
KEY_A = f"{SESSION}.{'a1' * 16}"  # as new_record_key makes them (fixed: test ids must not vary)
KEY_B = f"{SESSION}.{'b2' * 16}"
A0, A1 = provenance.sequence_ids(KEY_A, 2)
(B0,) = provenance.sequence_ids(KEY_B, 1)
PROMPT_A = [10, 11, 12, 13]
RECORDS = {
    A0: Recorded(PROMPT_A, [20, 21, 22], [-0.5, -0.25, -2.0]),
    A1: Recorded(PROMPT_A, [30], [-0.125]),
    # the next turn's request: the first turn, its answer and a new observation
    B0: Recorded(PROMPT_A + [20, 21, 22] + [40, 41], [50, 51], [-1.5, -0.75]),
}


def parsed(*data):
    req = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=list(data), loss_fn="stable_reinforce"),
        model_id=f"{SESSION}:train:0", seq_id=1)
    return wire.parse_forward_backward(forward_backward_request_to_proto(req).SerializeToString())


def rl_loop_datum(prompt, sampled, sid, logprobs=None, targets=None):
    """As the cookbook's recipes/rl_loop.py builds one (its with_sampled_provenance)."""
    n = len(prompt) - 1
    d = tinker.Datum(model_input=tinker.ModelInput.from_ints(prompt + sampled[:-1]),
                     loss_fn_inputs={"target_tokens": targets or [0] * n + sampled,
                                     "logprobs": [0.0] * n + (logprobs or [-9.0] * len(sampled)),
                                     "advantages": [0.0] * n + [1.0] * len(sampled)})
    return d.with_provenance(
        model_input=[tinker.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     tinker.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
        loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                        tinker.SampledProvenanceSpan(sequence_id=sid, length=len(sampled))])


def accepted(fb, records=RECORDS):
    named = provenance.named(fb.provenance, SESSION)
    provenance.check(fb.data, fb.provenance, {sid: records.get(sid) for sid in named})
    out = provenance.attach(fb.data, fb.provenance, records)
    assert all("logprobs" not in d.inputs for d in out)  # the client's: not read, not sent on
    return [(np.frombuffer(d.inputs["recorded_logprobs"].data, np.float32).tolist(),
             np.frombuffer(d.inputs["recorded_sequence"].data, np.int64).tolist()) for d in out]


def refused(fb, records=RECORDS):
    with pytest.raises(wire.WireError) as e:
        accepted(fb, records)
    return str(e.value)


def test_rl_loops_datums_get_the_recorded_sampler_logprobs_not_the_clients():
    fb = parsed(rl_loop_datum(PROMPT_A, [20, 21, 22], A0), rl_loop_datum(PROMPT_A, [30], A1))
    assert accepted(fb) == [([0.0] * 3 + [-0.5, -0.25, -2.0], [-1] * 3 + [0] * 3),
                            ([0.0] * 3 + [-0.125], [-1] * 3 + [0])]


def test_a_multi_turn_datum_names_two_sequences_and_the_second_prompts_offset():
    # rl/data_processing.py's trajectory_to_data: O1 A1 O2 A2, the input without the last
    # token, the targets without the first
    full = PROMPT_A + [20, 21, 22] + [40, 41] + [50, 51]
    runs = [tinker.PromptProvenanceSpan(sequence_id=A0, length=4),
            tinker.SampledProvenanceSpan(sequence_id=A0, length=3),
            tinker.PromptProvenanceSpan(sequence_id=B0, offset=7, length=2),
            tinker.SampledProvenanceSpan(sequence_id=B0, length=2)]
    n = len(full) - 1
    d = tinker.Datum(model_input=tinker.ModelInput.from_ints(full[:-1]),
                     loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * n, "advantages": [1.0] * n})
    first = runs[0]
    d = d.with_provenance(
        model_input=runs[:-1] + [tinker.SampledProvenanceSpan(sequence_id=B0, length=1)],
        loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id=A0, offset=1, length=first.length - 1)] + runs[1:])
    mu, which = accepted(parsed(d))[0]
    assert mu == [0.0] * 3 + [-0.5, -0.25, -2.0] + [0.0] * 2 + [-1.5, -0.75]
    assert which == [-1] * 3 + [0] * 3 + [-1] * 2 + [1] * 2


def test_a_datum_without_provenance_is_refused_naming_it():
    bare = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": [2, 3], "advantages": [1.0, 1.0]})
    assert "data[1]: loss_fn 'stable_reinforce' needs provenance" in refused(
        parsed(rl_loop_datum(PROMPT_A, [30], A1), bare))


@pytest.mark.parametrize("sid, message", [
    (f"{OTHER}.{'0' * 32}.0", "is not one of this session's"),           # another session's (any user's)
    ("ts-0123456789-s0.7.0", "is not a sequence id of this server"),   # the guessable request-id form
    (KEY_A, "is not a sequence id of this server"),                     # a record key, not a sequence
    ("x" * 128, "is not a sequence id of this server"),
])
def test_a_sequence_of_another_session_or_a_forged_id_is_refused(sid, message):
    with pytest.raises(wire.WireError, match=r"data\[0\]\.model_input_spans\[0\]: .*" + message):
        provenance.named(parsed(rl_loop_datum(PROMPT_A, [30], sid)).provenance, SESSION)


def test_a_sequence_never_recorded_expired_or_evicted_is_refused():
    fresh = provenance.new_record_key(SESSION)
    assert provenance.parse_sequence_id(f"{fresh}.0") == (SESSION, fresh, 0) and fresh != provenance.new_record_key(
        SESSION)
    unknown = provenance.sequence_ids(fresh, 1)[0]
    assert "no recorded sequence" in refused(parsed(rl_loop_datum(PROMPT_A, [30], unknown)))
    # the sample returned two sequences: a third is not there
    assert "no recorded sequence" in refused(parsed(rl_loop_datum(PROMPT_A, [30], f"{KEY_A}.2")))


def test_runs_that_do_not_tile_their_field_are_refused():
    d = rl_loop_datum(PROMPT_A, [20, 21, 22], A0)
    short = tinker.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs,
                         model_input_spans=d.model_input_spans[:1], loss_fn_input_spans=d.loss_fn_input_spans)
    assert "data[0].model_input_spans: the runs cover 4 positions, the field has 6" in refused(parsed(short))


def test_a_run_past_the_end_of_its_sequence_is_refused():
    # one sampled token recorded, three claimed (the input and targets forged to match)
    d = rl_loop_datum(PROMPT_A, [30, 31, 32], A1)
    assert "positions [0, 2) of sequence" in refused(parsed(d)) and "which has 1" in refused(parsed(d))
    # a prompt run whose offset runs past the recorded prompt
    d = rl_loop_datum(PROMPT_A, [30], A1)
    late = tinker.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs,
                        model_input_spans=[tinker.PromptProvenanceSpan(sequence_id=A1, offset=3, length=4)],
                        loss_fn_input_spans=d.loss_fn_input_spans)
    assert "data[0].model_input_spans[0]: positions [3, 7) of sequence" in refused(parsed(late))


def test_tokens_that_differ_from_the_recorded_ones_are_refused_naming_the_position():
    # a different prompt under the runs of A0
    assert "model_input[2] is 99, the recorded token" in refused(
        parsed(rl_loop_datum([10, 11, 99, 13], [20, 21, 22], A0)))
    # other sampled targets: what the loss would train on is not what was sampled
    d = rl_loop_datum(PROMPT_A, [20, 21, 22], A0, targets=[0, 0, 0, 20, 21, 23])
    assert "data[0].loss_fn_input_spans[1]: target_tokens[5] is 23" in refused(parsed(d))


def test_the_server_owned_inputs_and_malformed_runs_are_refused_at_the_wire():
    d = rl_loop_datum(PROMPT_A, [30], A1)
    forged = tinker.Datum(model_input=d.model_input,
                          loss_fn_inputs={**d.loss_fn_inputs, "recorded_logprobs": np.zeros(4, np.float32)},
                          model_input_spans=d.model_input_spans, loss_fn_input_spans=d.loss_fn_input_spans)
    with pytest.raises(wire.WireError, match=r"data\[0\]\.loss_fn_inputs\['recorded_logprobs'\]: the server's own"):
        parsed(forged)
    req = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=[d], loss_fn="stable_reinforce"),
        model_id=f"{SESSION}:train:0", seq_id=1)
    msg = forward_backward_request_to_proto(req)
    msg.data[0].model_input_spans[0].prompt_tokens.offset = -5
    with pytest.raises(wire.WireError, match=r"model_input_spans\[0\]: offset -5 and length 4 must be >= 0"):
        wire.parse_forward_backward(msg.SerializeToString())
    msg = forward_backward_request_to_proto(req)
    for _ in range(wire.MAX_SPANS_PER_FIELD):
        msg.data[0].loss_fn_input_spans.add().sampled_tokens.sequence_id = A1
    with pytest.raises(wire.WireError, match=r"loss_fn_input_spans: \d+ runs \(at most"):
        wire.parse_forward_backward(msg.SerializeToString())
    msg = forward_backward_request_to_proto(req)
    msg.data[0].model_input_spans.add(prompt_tokens=pb.PromptProvenanceSpan(sequence_id="", length=0))
    with pytest.raises(wire.WireError, match=r"model_input_spans\[2\]\.sequence_id: 0 characters"):
        wire.parse_forward_backward(msg.SerializeToString())
