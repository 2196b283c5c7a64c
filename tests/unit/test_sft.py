"""SFT data: chat and prompt/completion rows from JSONL and Parquet, masks exactly on
the assistant's tokens, clear errors for bad files, token-exact replay of a filtered
slice of the trajectory log; the seeded sampler; the engine's SFT step."""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opentinker.schemas import JobSpec, Trajectory, TurnRecord
from opentinker.services.core.access import Tenant
from opentinker.services.learner.sft import (
    Example, load_examples, sft_batches, step_indices,
)

CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8."},
]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _spec(**kw) -> JobSpec:
    return JobSpec(algorithm="sft", **kw)


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _masked_runs(ex: Example) -> list[list[int]]:
    """The maximal runs of loss-mask-1 tokens."""
    runs, cur = [], []
    for t, m in zip(ex.token_ids, ex.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_chat_mask_is_exactly_the_assistant_turns(tmp_path, tok):
    [ex] = load_examples(_spec(sft_data=_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])), tmp_path, tok)
    full = tok.apply_chat_template(CHAT, tokenize=False)
    # the same tokens the template's text gives, nothing added or lost
    assert ex.token_ids == tok(full, add_special_tokens=False)["input_ids"]
    assert len(ex.loss_mask) == len(ex.token_ids)
    runs = [tok.decode(r) for r in _masked_runs(ex)]
    assert runs == ["5<|im_end|>", "It is 8.<|im_end|>"]
    # and nothing of the system/user turns or the assistant headers is trained on
    masked_out = tok.decode([t for t, m in zip(ex.token_ids, ex.loss_mask) if not m])
    assert "You add numbers." in masked_out and "And 4 + 4?" in masked_out
    assert masked_out.count("<|im_start|>assistant\n") == 2


def test_prompt_completion_trains_on_completion_and_eos(tmp_path, tok):
    rows = [{"prompt": "What is 2 + 2?", "completion": "4"}]
    [ex] = load_examples(_spec(sft_data=_jsonl(tmp_path / "d.jsonl", rows)), tmp_path, tok)
    head = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                   add_generation_prompt=True)
    n = len(tok(head, add_special_tokens=False)["input_ids"])
    assert ex.loss_mask == [0] * n + [1] * (len(ex.token_ids) - n)
    assert tok.decode(ex.token_ids[n:]) == "4<|im_end|>"
    assert ex.token_ids[-1] == tok.eos_token_id


def test_parquet_gives_the_same_examples_as_jsonl(tmp_path, tok):
    rows = [{"messages": CHAT}, {"messages": CHAT[1:3]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    from_pq = load_examples(_spec(sft_data=str(tmp_path / "d.parquet")), tmp_path, tok)
    from_jsonl = load_examples(_spec(sft_data=_jsonl(tmp_path / "d.jsonl", rows)), tmp_path, tok)
    assert from_pq == from_jsonl and len(from_pq) == 2
    pc = [{"prompt": "p", "completion": "c"}]
    pq.write_table(pa.Table.from_pylist(pc), tmp_path / "pc.parquet")
    assert (load_examples(_spec(sft_data=str(tmp_path / "pc.parquet")), tmp_path, tok)
            == load_examples(_spec(sft_data=_jsonl(tmp_path / "pc.jsonl", pc)), tmp_path, tok))


def test_long_examples_are_cut_from_the_right(tmp_path, tok):
    rows = [{"prompt": "hi", "completion": "word " * 100}]
    [ex] = load_examples(_spec(sft_data=_jsonl(tmp_path / "d.jsonl", rows)), tmp_path, tok, max_tokens=40)
    [full] = load_examples(_spec(sft_data=_jsonl(tmp_path / "d.jsonl", rows)), tmp_path, tok)
    assert ex.token_ids == full.token_ids[:40] and ex.loss_mask == full.loss_mask[:40]


@pytest.mark.parametrize("content, where, words", [
    ('{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": 1}\n', "line 1", "no assistant message"),
    ('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n', "line 2", "`completion`"),
    ('{"prompt": "a", "completion": "b"}\n{oops\n', "line 2", "not JSON"),
    ('{"text": "a"}\n', "line 1", "needs `messages`"),
    ('{"messages": [{"role": "user", "content": 3}]}\n', "line 1", "messages[0]"),
    ('[1, 2]\n', "line 1", "must be an object"),
])
def test_malformed_rows_name_the_file_and_row(tmp_path, tok, content, where, words):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(ValueError) as e:
        load_examples(_spec(sft_data=str(p)), tmp_path, tok)
    msg = str(e.value)
    assert msg.startswith("sft_data:") and str(p) in msg and where in msg and words in msg


def test_bad_files_are_named(tmp_path, tok):
    with pytest.raises(ValueError, match="sft_data: .*missing.jsonl: no such file"):
        load_examples(_spec(sft_data=str(tmp_path / "missing.jsonl")), tmp_path, tok)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        load_examples(_spec(sft_data=str(tmp_path / "d.csv")), tmp_path, tok)
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        load_examples(_spec(sft_data=str(tmp_path / "d.parquet")), tmp_path, tok)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no rows"):
        load_examples(_spec(sft_data=str(tmp_path / "empty.jsonl")), tmp_path, tok)


# -- replay from the log ----------------------------------------------------------

def _traj(job_id: str, k: int, reward: float) -> Trajectory:
    ids = [1, 100 + k, 200 + k, 300 + k, 2, 400 + k, 2]
    mask = [0, 0, 0, 0, 0, 1, 1]
    return Trajectory(
        job_id=job_id, request_id=f"{job_id}-s0-g0", episode_id=f"{job_id}-e{k}", step=0, group_index=0,
        group_size=4, token_ids=ids, loss_mask=mask, logprobs=[-0.5 * m for m in mask], prompt_len=5,
        turns=[TurnRecord(gen_start=5, gen_end=7, obs_end=7, reward=reward)], reward=reward,
        policy_version=0, env="arith", created_s=time.time())


def write_log(log_dir, job_id: str, rewards: list[float]) -> list[Trajectory]:
    """Write trajectories as the recorder does (one Parquet part)."""
    from opentinker.services.recorder.store import trajectory_rows, write_part

    trajs = [_traj(job_id, k, r) for k, r in enumerate(rewards)]
    write_part(log_dir, "trajectories", job_id,
               [row for seq, t in enumerate(trajs, 1) for row in trajectory_rows(t, seq)])
    return trajs


def test_query_replays_the_filtered_slice_token_exact(tmp_path, tok):
    log_dir = tmp_path / "data"
    trajs = write_log(log_dir, "job-a", [1.0, 0.0, 1.0, 0.0])
    write_log(log_dir, "job-b", [1.0])
    sql = "SELECT * FROM trajectories WHERE job_id = 'job-a' AND reward = 1 ORDER BY episode_id"
    got = load_examples(_spec(sft_query=sql), tmp_path, tok, log_dir=log_dir)
    assert got == [Example(list(t.token_ids), list(t.loss_mask)) for t in (trajs[0], trajs[2])]
    # `<home>/data` is the default log
    assert load_examples(_spec(sft_query=sql), tmp_path, tok) == got
    # only the two columns are needed
    two = load_examples(_spec(sft_query="SELECT token_ids, loss_mask FROM trajectories "
                                        "WHERE job_id = 'job-b'"), tmp_path, tok)
    assert two == [Example(list(trajs[0].token_ids[:1]) + [100, 200, 300, 2, 400, 2], list(trajs[0].loss_mask))]


@pytest.mark.parametrize("sql, words", [
    ("SELEC * FROM trajectories", "the query failed"),
    ("SELECT * FROM nowhere", "the query failed"),
    ("SELECT * FROM trajectories WHERE job_id = 'nobody'", "no rows"),
    ("SELECT reward, loss_mask FROM trajectories", "no token_ids column"),
    ("SELECT token_ids, [1, 0] AS loss_mask FROM trajectories", "len(loss_mask)"),
])
def test_bad_queries_name_sft_query(tmp_path, tok, sql, words):
    write_log(tmp_path / "data", "job-a", [1.0])
    with pytest.raises(ValueError) as e:
        load_examples(_spec(sft_query=sql), tmp_path, tok)
    assert str(e.value).startswith("sft_query:") and words in str(e.value)


def test_query_token_ids_outside_the_vocabulary_are_refused(tmp_path, tok):
    write_log(tmp_path / "data", "job-a", [1.0])
    with pytest.raises(ValueError, match=r"sft_query: row 0 \(episode_id job-a-e0\): token ids must be in"):
        load_examples(_spec(sft_query="SELECT * FROM trajectories"), tmp_path, tok, vocab_size=300)


# -- a tenant's job: own rows, own files ---------------------------------------------

ALICE = Tenant(user="alice", admin=False, own_jobs=frozenset({"job-a"}))


def test_a_tenants_query_sees_only_their_own_jobs(tmp_path, tok):
    write_log(tmp_path / "data", "job-a", [1.0, 1.0])
    write_log(tmp_path / "data", "job-b", [1.0])
    every = _spec(sft_query="SELECT * FROM trajectories")
    assert len(load_examples(every, tmp_path, tok, tenant=ALICE)) == 2
    assert len(load_examples(every, tmp_path, tok)) == 3  # the operator's own call: every job
    theirs = _spec(sft_query="SELECT * FROM trajectories WHERE job_id = 'job-b'")
    with pytest.raises(ValueError, match="sft_query: the query returned no rows"):
        load_examples(theirs, tmp_path, tok, tenant=ALICE)
    with pytest.raises(ValueError, match="sft_query: must be exactly one SELECT"):
        load_examples(_spec(sft_query="COPY trajectories TO 'x.csv'"), tmp_path, tok, tenant=ALICE)


def test_a_tenants_sft_data_lies_in_their_area(tmp_path, tok):
    from opentinker.schemas.job import SpecError
    from opentinker.services.core.access import user_area

    area = user_area(tmp_path, "alice")
    area.mkdir(parents=True)
    rows = [{"prompt": "What is 2 + 2?", "completion": "4"}]
    _jsonl(area / "d.jsonl", rows)
    # a relative path starts in the area
    got = load_examples(_spec(sft_data="d.jsonl"), tmp_path, tok, tenant=ALICE)
    assert got == load_examples(_spec(sft_data=str(area / "d.jsonl")), tmp_path, tok)
    outside = _jsonl(tmp_path / "elsewhere.jsonl", rows)
    for path in (outside, "/etc/passwd", "../bob/d.jsonl"):
        with pytest.raises(SpecError) as e:
            load_examples(_spec(sft_data=path), tmp_path, tok, tenant=ALICE)
        assert e.value.field == "sft_data" and str(e.value).startswith("invalid job spec: `sft_data`:")
    admin = Tenant(user="root", admin=True)
    assert load_examples(_spec(sft_data=outside), tmp_path, tok, tenant=admin) == got


# -- sampling and batching --------------------------------------------------------

def test_steps_walk_seeded_epochs_deterministically():
    n, bs = 10, 4
    seq = [i for s in range(5) for i in step_indices(n, bs, s, seed=7)]
    assert sorted(seq[:10]) == list(range(10)) and sorted(seq[10:20]) == list(range(10))
    assert seq == [i for s in range(5) for i in step_indices(n, bs, s, seed=7)]  # resume: same order
    assert seq != [i for s in range(5) for i in step_indices(n, bs, s, seed=8)]
    assert step_indices(3, 8, 0, seed=0).count(0) >= 2  # a batch larger than the data spans epochs


def test_sft_batches_align_the_mask_to_targets():
    exs = [Example([1, 2, 3, 4], [0, 0, 1, 1]), Example([5, 6], [0, 1])]
    [b] = sft_batches(exs, micro_batch_size=2, pad_id=0)
    assert b.loss_mask.tolist() == [[1, 0, 0, 0], [0, 1, 1, 0]]  # sorted by length
    assert b.num_tokens == 3 and b.advantages.tolist() == [0.0, 0.0]


# -- the engine -------------------------------------------------------------------

def test_engine_sft_step_lowers_the_masked_nll(tiny_model, tok, monkeypatch):
    import math

    from opentinker.services.learner.engine_deepspeed import TrainEngine

    # the engine sets its one-process group's rank variables; keep them out of the
    # environment that services started by later tests inherit
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, os.environ.get(key, value))

    exs = [Example(*_enc(tok, f"What is {a} + {a}?", str(2 * a))) for a in range(6)]
    spec = _spec(sft_data="x.jsonl", sft_batch_size=6, micro_batch_size=4, lr=1e-2, lora_rank=0)
    eng = TrainEngine(spec, tiny_model, device="cpu")
    try:
        batches = sft_batches(exs, spec.micro_batch_size, eng.pad_id)
        assert len(batches) == 2
        before = eng.sft_eval(batches)
        out = eng.sft_step(batches)
        # the step reports the mean NLL over every micro-batch's loss tokens, before its update
        assert out["tokens"] == before["tokens"] == sum(sum(e.loss_mask[1:]) for e in exs)
        assert math.isclose(out["loss"], before["loss"], rel_tol=1e-4)
        assert out["grad_norm"] > 0
        for _ in range(4):
            eng.sft_step(batches)
        after = eng.sft_eval(batches)["loss"]
        assert after < before["loss"] - 1.0
    finally:
        eng.close()


def _enc(tok, prompt, completion):
    from opentinker.services.learner.sft import encode_prompt_completion

    ex = encode_prompt_completion(prompt, completion, tok)
    return ex.token_ids, ex.loss_mask
