"""Datum provenance for the loss `stable_reinforce` (pure: no I/O): the sequence ids of
a recorded sample, a forward_backward's provenance checked against what was recorded,
and the loss's server-side inputs built from the records.

Tinker's contract (https://tinker-docs.thinkingmachines.ai/tinker/datum/, Provenance;
the SDK's types/provenance_spans.py): a sampling client created with
`record_stability_info=True` has the server record each sample, and every returned
sequence carries a `sequence_id`; a training datum names, run by run, which sequence's
prompt or sampled tokens each of its positions reproduces (`model_input_spans` tile its
input tokens, `loss_fn_input_spans` its target_tokens). Only sequences of the training
model's own session may be named, for a day after their last use.

Here a sample's record key is `<session>.<32 random hex digits>` and its i-th sequence
`<record key>.<i>` (RECORD_KEY_RE, SEQUENCE_RE): unguessable, and naming its session.
`check` refuses, naming the datum and the run (a 400 at the API):
- a datum without provenance, or whose runs do not tile its field (their lengths sum to
  the field's length);
- a sequence id that is malformed or of another session (another user's session
  included), or that was not recorded (sampled without record_stability_info, unused
  for a day, evicted over the session's recording bounds, or its sample not yet
  retrieved);
- a run past the end of the sequence's prompt or sampled tokens;
- input tokens under any run, and target tokens under a sampled run, that differ from
  the recorded ones. Target tokens under a prompt run are not compared: they carry no
  advantage, and the cookbook's rl_loop sends 0 there (its targets are
  `[0] * (len(prompt) - 1) + sampled`).
`attach` then adds the datum's `recorded_logprobs` [N] float32 (the sampler's logprob,
as recorded, at each target position under a sampled run; 0 elsewhere) and
`recorded_sequence` [N] int64 (the index, in the datum's order of first mention, of the
sampled sequence at each such position; -1 elsewhere), the inputs the learner's
stable_reinforce reads (learner/tinker_losses.py). Several sequences per datum (a
multi-turn episode, the cookbook's rl/data_processing.py) are each their own sequence
there. The datum's own `logprobs` input, which the loss does not read, is dropped.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from opentinker.schemas.tinker import RECORD_KEY_RE, TinkerDatum, TinkerTensor
from opentinker.services.tinker.wire import Provenance, WireError

SEQUENCE_RE = re.compile(r"^(ts-[0-9a-f]{10})\.([0-9a-f]{32})\.(\d{1,3})$")
MAX_NAMED_SEQUENCES = 16_384  # distinct sequences one forward_backward may name


class Recorded(NamedTuple):
    """What was recorded of one sampled sequence: its request's prompt tokens, its
    sampled tokens and the sampler's logprob of each."""

    prompt: Sequence[int]
    tokens: Sequence[int]
    logprobs: Sequence[float]


def new_record_key(session_id: str) -> str:
    """A fresh record key of the session (module docstring)."""
    key = f"{session_id}.{secrets.token_hex(16)}"
    assert RECORD_KEY_RE.match(key), key
    return key


def sequence_ids(record_key: str, n: int) -> list[str]:
    """The ids of a sample's `n` sequences, `<record_key>.<i>` (a sample not recorded
    passes its request id: ids no provenance can name)."""
    return [f"{record_key}.{i}" for i in range(n)]


def parse_sequence_id(sid: str) -> tuple[str, str, int]:
    """(session id, record key, index) of sequence id `sid`. Raises WireError."""
    m = SEQUENCE_RE.match(sid)
    if not m:
        raise WireError(f"sequence {sid[:80]!r} is not a sequence id of this server (sample with "
                        "record_stability_info=True and name a returned SampledSequence.sequence_id)")
    return m.group(1), f"{m.group(1)}.{m.group(2)}", int(m.group(3))


def named(provenance: Sequence[Provenance | None], session_id: str) -> dict[str, tuple[str, int]]:
    """Every sequence the datums' runs name -> (record key, index), each checked to be
    a well-formed id of session `session_id`. Raises WireError naming the datum and run
    for a datum without provenance, a malformed id, another session's, or more than
    MAX_NAMED_SEQUENCES distinct ones."""
    out: dict[str, tuple[str, int]] = {}
    for i, p in enumerate(provenance):
        if p is None:
            raise WireError(f"data[{i}]: loss_fn 'stable_reinforce' needs provenance on every datum "
                            "(Datum.with_provenance, naming the sequences of a sampling client created with "
                            "record_stability_info=True)")
        for field, spans in (("model_input_spans", p.inputs), ("loss_fn_input_spans", p.targets)):
            for j, span in enumerate(spans):
                if span.sequence_id in out:
                    continue
                try:
                    session, key, index = parse_sequence_id(span.sequence_id)
                except WireError as e:
                    raise WireError(f"data[{i}].{field}[{j}]: {e}") from None
                if session != session_id:
                    raise WireError(f"data[{i}].{field}[{j}]: sequence {span.sequence_id[:80]!r} is not one of "
                                    f"this session's ({session_id}): train in the session that sampled it")
                out[span.sequence_id] = (key, index)
                if len(out) > MAX_NAMED_SEQUENCES:
                    raise WireError(f"data: over {MAX_NAMED_SEQUENCES} distinct sequences named in one request")
    return out


def check(data: Sequence[TinkerDatum], provenance: Sequence[Provenance | None],
          records: Mapping[str, Recorded | None]) -> None:
    """Check every datum's provenance against `records` (sequence id -> what was
    recorded, None: nothing). Raises WireError naming the datum and run (module
    docstring); `named` has checked the ids."""
    for i, (d, p) in enumerate(zip(data, provenance, strict=True)):
        assert p is not None
        targets = _targets(d, i)
        for field, spans, tokens in (("model_input_spans", p.inputs, np.asarray(d.tokens, np.int64)),
                                     ("loss_fn_input_spans", p.targets, targets)):
            total = sum(s.length for s in spans)
            if total != len(tokens):
                raise WireError(f"data[{i}].{field}: the runs cover {total} positions, the field has "
                                f"{len(tokens)}: they must tile it exactly")
            pos = 0
            for j, s in enumerate(spans):
                where = f"data[{i}].{field}[{j}]"
                rec = records.get(s.sequence_id)
                if rec is None:
                    raise WireError(f"{where}: no recorded sequence {s.sequence_id!r} (sampled without "
                                    "record_stability_info=True, its sample not yet retrieved, unused for a day, "
                                    "or evicted over the session's recording bounds)")
                source = rec.prompt if s.kind == "prompt" else rec.tokens
                what = "prompt" if s.kind == "prompt" else "sampled tokens"
                if s.offset + s.length > len(source):
                    raise WireError(f"{where}: positions [{s.offset}, {s.offset + s.length}) of sequence "
                                    f"{s.sequence_id!r}'s {what}, which has {len(source)}")
                if field == "model_input_spans" or s.kind == "sampled":
                    got = tokens[pos:pos + s.length]
                    want = np.asarray(source[s.offset:s.offset + s.length], np.int64)
                    if not np.array_equal(got, want):
                        first = int(np.flatnonzero(got != want)[0])
                        name = "model_input" if field == "model_input_spans" else "target_tokens"
                        raise WireError(f"{where}: {name}[{pos + first}] is {int(got[first])}, the recorded "
                                        f"token of sequence {s.sequence_id!r}'s {what} at {s.offset + first} is "
                                        f"{int(want[first])}")
                pos += s.length


def attach(data: Sequence[TinkerDatum], provenance: Sequence[Provenance | None],
           records: Mapping[str, Recorded]) -> list[TinkerDatum]:
    """`data` with each datum's recorded_logprobs and recorded_sequence inputs added
    (module docstring); `check` has passed."""
    out = []
    for i, (d, p) in enumerate(zip(data, provenance, strict=True)):
        assert p is not None
        n = len(d.tokens)
        mu = np.zeros(n, np.float32)
        which = np.full(n, -1, np.int64)
        order: dict[str, int] = {}
        pos = 0
        for s in p.targets:
            if s.kind == "sampled" and s.length:
                rec = records[s.sequence_id]
                mu[pos:pos + s.length] = rec.logprobs[s.offset:s.offset + s.length]
                which[pos:pos + s.length] = order.setdefault(s.sequence_id, len(order))
            pos += s.length
        # the client's `logprobs` are not read (the recorded ones are): dropped, which keeps
        # the op within the stream's message size for a chunk the SDK filled
        inputs = {k: v for k, v in d.inputs.items() if k != "logprobs"}
        inputs["recorded_logprobs"] = TinkerTensor(dtype="float32", shape=[n], data=mu.tobytes())
        inputs["recorded_sequence"] = TinkerTensor(dtype="int64", shape=[n], data=which.tobytes())
        out.append(TinkerDatum(tokens=d.tokens, inputs=inputs))
    return out


def _targets(d: TinkerDatum, i: int) -> np.ndarray:
    """Datum `i`'s target_tokens as int64 [N]. Raises WireError when it has none."""
    t = d.inputs.get("target_tokens")
    if t is None:
        raise WireError(f"data[{i}]: loss_fn 'stable_reinforce' needs loss_fn_inputs['target_tokens']")
    if t.dtype != "int64" or len(t.shape) > 1:
        raise WireError(f"data[{i}].loss_fn_inputs['target_tokens']: integer token ids of shape [N]")
    return np.frombuffer(t.data, np.int64)
