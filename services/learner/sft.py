"""Supervised fine-tuning as a job type (`algorithm = "sft"`), including replay from
the trajectory log.

Data, in one of two forms (JobSpec.sft_data / JobSpec.sft_query):
- a dataset file on the learner's machine, JSONL or Parquet, one example per row:
  `messages` (a chat: [{role, content}, ...]) rendered with the tokenizer's chat
  template, trained on the assistant messages only; or `prompt` + `completion` (the
  prompt as a user message with the generation prompt, trained on the completion
  and EOS). Masking only the assistant tokens follows TRL's SFTTrainer
  (`assistant_only_loss`, and `completion_only_loss` for prompt-completion data).
- a DuckDB query over the `trajectories` view of the log (services/core/logdb.py),
  e.g. `SELECT * FROM trajectories WHERE job_id = 'x' AND reward = 1`: the rows'
  `token_ids` and `loss_mask` are replayed exactly as sampled, never retokenized
  (rejection-sampling fine-tuning / expert iteration on one's own successes).

Objective: mean negative log-likelihood of the loss-mask tokens over an optimizer
step (the standard causal-LM cross-entropy; engine_deepspeed.TrainEngine.sft_step).

SFTRun drives such a job on the learner: `steps` optimizer steps of `sft_batch_size`
examples in a seeded epoch-wise shuffle (a pure function of seed and step, so a
resumed job continues the same order), new weights published after every step (so
rollout and `opentinker infer` serve the latest policy), metrics per step, checkpoints
every `checkpoint_every` steps, the Hugging Face export at the end. It writes the same
subjects as an RL job (service.py) except rollout requests, and reads no trajectories
from the bus.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.schemas import JobSpec
from opentinker.services.core.access import Tenant, confine_path
from opentinker.services.learner import checkpoint
from opentinker.services.learner.batching import Batch, micro_batches
from opentinker.services.learner.ledger import no_stream_meta
from opentinker.services.learner.lifecycle import RunLifecycle

log = logging.getLogger("opentinker.learner.sft")

# examples longer than this are cut from the right (the start of a chat is kept)
MAX_TOKENS = 2048
# `loss_full_before/after` are measured on at most this many examples (a fixed
# seeded subset), so a large dataset does not make them cost more than training
MAX_EVAL_EXAMPLES = 512


@dataclass(frozen=True)
class Example:
    """One SFT example, with a Trajectory's semantics.

    token_ids: [seq] int   the tokens, in order
    loss_mask: [seq] int   1 = train on this token (predict it), 0 = context only
    """

    token_ids: list[int]
    loss_mask: list[int]

    @property
    def logprobs(self) -> list[float]:
        """Zeros: lets batching.build_batch take an Example like a Trajectory (there is
        no sampler here)."""
        return [0.0] * len(self.token_ids)

    @property
    def images(self) -> list[bytes]:
        """None: SFT examples are text (build_batch reads a Trajectory's images)."""
        return []


# -- from the trajectory log ------------------------------------------------------

def examples_from_query(sql: str, log_dir: str | Path, vocab_size: int | None = None,
                        max_tokens: int = MAX_TOKENS, *, job_ids: Iterable[str] | None) -> list[Example]:
    """The rows of `sql` (DuckDB over the log's tables) as Examples, token-exact.

    The SQL is untrusted (a tenant's): it sees only the rows of `job_ids` (None: every
    job, for an admin or operator), can read no file, and must be one SELECT
    (logdb.run_user_query).

    Raises ValueError naming `sft_query` when the SQL is refused or fails, returns no
    rows, lacks a `token_ids` or `loss_mask` column, or a row is malformed (lengths
    differ, a mask value other than 0/1, a token id outside [0, vocab_size)).
    """
    from opentinker.services.core.logdb import run_user_query

    cols, rows = run_user_query(sql, log_dir, job_ids, field="sft_query")
    missing = [c for c in ("token_ids", "loss_mask") if c not in cols]
    if missing:
        raise ValueError(f"sft_query: the result has no {' or '.join(missing)} column "
                         f"(columns: {', '.join(cols) or 'none'}); select them from `trajectories`")
    if not rows:
        raise ValueError(f"sft_query: the query returned no rows (log at {log_dir})")
    ti, mi = cols.index("token_ids"), cols.index("loss_mask")
    ei = cols.index("episode_id") if "episode_id" in cols else None
    out = []
    for k, row in enumerate(rows):
        where = f"sft_query: row {k}" + (f" (episode_id {row[ei]})" if ei is not None else "")
        ids, mask = row[ti], row[mi]
        if ids is None or mask is None:
            raise ValueError(f"{where}: token_ids or loss_mask is NULL")
        ids, mask = [int(x) for x in ids], [int(x) for x in mask]
        if len(ids) != len(mask):
            raise ValueError(f"{where}: len(loss_mask) {len(mask)} != len(token_ids) {len(ids)}")
        if any(m not in (0, 1) for m in mask):
            raise ValueError(f"{where}: loss_mask values must be 0 or 1")
        if vocab_size is not None and ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(f"{where}: token ids must be in [0, {vocab_size}) (a log of another model?)")
        out.append(_truncate(Example(ids, mask), max_tokens))
    return _keep_trainable(out, "sft_query")


# -- from a dataset file ----------------------------------------------------------

def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _ids(tokenizer: Any, text: str) -> list[int]:
    # the template already holds BOS/special tokens as text (as the rollout's agent loop)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _end_of_turn(tokenizer: Any, seg: list[int]) -> int:
    """How many tokens of an assistant segment ("content<|im_end|>\\n") to train on:
    through its last special token (the end-of-turn token), or all of it if it has none.
    What the template puts after that (a newline) is formatting the policy never emits."""
    special = set(tokenizer.all_special_ids)
    if tokenizer.eos_token_id is not None:
        special.add(tokenizer.eos_token_id)
    for j in range(len(seg) - 1, -1, -1):
        if seg[j] in special:
            return j + 1
    return len(seg)


def encode_messages(messages: list[dict[str, Any]], tokenizer: Any) -> Example:
    """A chat rendered with the tokenizer's chat template; loss mask 1 exactly on each
    assistant message's content tokens and its end-of-turn token.

    Each assistant message's tokens are the difference between the rendering of the
    chat up to it and the rendering before it with the generation prompt, tokenized
    piecewise as the rollout's agent loop tokenizes a prompt and then appends sampled
    tokens. Raises ValueError for a chat with no assistant message or a template that
    re-renders earlier messages differently (not prefix-stable).
    """
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("no assistant message to train on")
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the text tokenized so far

    def extend(text: str, train: bool) -> None:
        nonlocal done
        if not text.startswith(done):
            raise ValueError("the chat template renders earlier messages differently once later "
                             "ones are added (not prefix-stable); use prompt/completion rows")
        seg = _ids(tokenizer, text[len(done):])
        n = _end_of_turn(tokenizer, seg) if train else 0
        ids.extend(seg)
        mask.extend([1] * n + [0] * (len(seg) - n))
        done = text

    for k, msg in enumerate(messages):
        if msg.get("role") == "assistant":
            extend(_render(tokenizer, messages[:k], add_generation_prompt=True), train=False)
            extend(_render(tokenizer, messages[: k + 1], add_generation_prompt=False), train=True)
        else:
            extend(_render(tokenizer, messages[: k + 1], add_generation_prompt=False), train=False)
    return Example(ids, mask)


def encode_prompt_completion(prompt: str | list[dict[str, Any]], completion: str, tokenizer: Any) -> Example:
    """`prompt` (text, as one user message, or a chat) rendered with the generation
    prompt, then `completion`'s tokens and EOS: loss mask 1 on those. Raises ValueError
    if the tokenizer has no EOS token."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to end the completion with")
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    head = _ids(tokenizer, _render(tokenizer, chat, add_generation_prompt=True))
    tail = _ids(tokenizer, completion) + [tokenizer.eos_token_id]
    return Example(head + tail, [0] * len(head) + [1] * len(tail))


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("`messages` must be a non-empty list of {role, content}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"`messages[{k}]` must be an object with string `role` and `content`")
    return messages


def encode_row(row: Any, tokenizer: Any) -> Example:
    """One dataset row ({"messages": [...]} or {"prompt": ..., "completion": ...}) as an
    Example. Raises ValueError naming the field that is missing or malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    if row.get("messages") is not None:
        return encode_messages(_check_messages(row["messages"]), tokenizer)
    if "prompt" in row or "completion" in row:
        prompt, completion = row.get("prompt"), row.get("completion")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and _check_messages(prompt))):
            raise ValueError("`prompt` must be a string or a list of {role, content}")
        if not isinstance(completion, str):
            raise ValueError("`completion` must be a string")
        return encode_prompt_completion(prompt, completion, tokenizer)
    raise ValueError(f"needs `messages`, or `prompt` and `completion` (has: {', '.join(sorted(row)) or 'nothing'})")


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of a JSONL (`.jsonl`, `.json`) or Parquet file; `where`
    is "line N" or "row N" (1-based). Raises ValueError for an unknown suffix or a line
    that is not JSON."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"line {n}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"sft_data: {path} line {n}: not JSON ({e})") from None
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise ValueError(f"sft_data: {path}: not a readable Parquet file ({e})") from None
        for n, row in enumerate(table.to_pylist(), 1):
            yield f"row {n}", row
    else:
        raise ValueError(f"sft_data: {path}: unknown format {suffix!r} (expected .jsonl or .parquet)")


def examples_from_file(path: str | Path, tokenizer: Any, max_tokens: int = MAX_TOKENS) -> list[Example]:
    """Every row of a JSONL or Parquet dataset as an Example. Raises ValueError naming
    `sft_data`, the file and the row for a missing file or malformed data."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"sft_data: {p}: no such file on the learner's machine")
    out = []
    for where, row in read_rows(p):
        try:
            ex = encode_row(row, tokenizer)
        except ValueError as e:
            raise ValueError(f"sft_data: {p} {where}: {e}") from None
        out.append(_truncate(ex, max_tokens))
    if not out:
        raise ValueError(f"sft_data: {p}: no rows")
    return _keep_trainable(out, f"sft_data: {p}")


# -- both -------------------------------------------------------------------------

def _truncate(ex: Example, max_tokens: int) -> Example:
    if len(ex.token_ids) <= max_tokens:
        return ex
    return Example(ex.token_ids[:max_tokens], ex.loss_mask[:max_tokens])


def _keep_trainable(examples: list[Example], source: str) -> list[Example]:
    # the first token has nothing before it to predict it from (batching drops its mask)
    keep = [e for e in examples if any(e.loss_mask[1:])]
    if not keep:
        raise ValueError(f"{source}: no example has a token to train on (loss_mask all 0, "
                         f"or cut off by the {MAX_TOKENS}-token limit)")
    if len(keep) < len(examples):
        log.warning("%s: %d of %d examples have no token to train on; skipped",
                    source, len(examples) - len(keep), len(examples))
    return keep


def load_examples(spec: JobSpec, home: str | Path, tokenizer: Any, log_dir: str | Path | None = None,
                  vocab_size: int | None = None, max_tokens: int = MAX_TOKENS,
                  tenant: Tenant | None = None) -> list[Example]:
    """The job's examples: `spec.sft_query` run over the log at `log_dir` (default
    `<home>/data`), or `spec.sft_data` read and tokenized with `tokenizer`.

    `tenant` is the job's owner (access.tenant_of_job): a non-admin's query sees only
    the rows of their own jobs, and their `sft_data` must lie in their area
    (`<home>/users/<user>/`, where a relative path starts) or their own jobs'
    checkpoints (access.confine_path). None: an operator's own call, no limits.

    Cut to `max_tokens` from the right; examples left with no token to train on are
    skipped. Raises ValueError naming sft_query or sft_data (and the file and row) for
    refused or bad SQL, an empty result, or malformed data; SpecError (a ValueError)
    naming sft_data for a file the tenant may not name.
    """
    tenant = tenant or Tenant(user="", admin=True)
    if spec.sft_query:
        return examples_from_query(spec.sft_query, log_dir or Path(home) / "data", vocab_size, max_tokens,
                                   job_ids=tenant.log_jobs)
    if spec.sft_data:
        path = confine_path(spec.sft_data, field="sft_data", **tenant.rules(home))
        examples = examples_from_file(path, tokenizer, max_tokens)
        if vocab_size is not None and any(max(e.token_ids) >= vocab_size for e in examples):
            raise ValueError(f"sft_data: the tokenizer makes ids >= the model's vocabulary ({vocab_size})")
        return examples
    raise ValueError("sft_data: an SFT job needs sft_data or sft_query")


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """A permutation of range(n), a pure function of (n, seed, epoch)."""
    order = list(range(n))
    random.Random(f"sft:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def step_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Which of `n` examples step `step` trains on: positions [step * batch_size,
    (step + 1) * batch_size) of the concatenated per-epoch shuffles (every example once
    per epoch; a batch may span two epochs)."""
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, k = divmod(pos, n)
        out.append(epoch_order(n, seed, epoch)[k])
    return out


def sft_batches(examples: Sequence[Example], micro_batch_size: int, pad_id: int) -> list[Batch]:
    """Target-aligned micro-batches (batching.py) of at most `micro_batch_size`."""
    return micro_batches(examples, [0.0] * len(examples), micro_batch_size, pad_id)


# -- the job ----------------------------------------------------------------------

class SFTRun(RunLifecycle):
    """One SFT job on this learner, from its assignment to a terminal state.

    Shares the GRPO run's lifecycle (lifecycle.py: events and cancel, weight publishing,
    checkpoints with an empty trajectory-stream position, resume); the sampler position
    is a pure function of (seed, step), so the step alone resumes it.

    Metrics per step (split "train"): loss (mean NLL per loss token, nats), grad_norm,
    tokens, examples, epoch, step_time_s, train_time_s, tokens_per_s; plus
    loss_full_before at step 0 and loss_full_after at the last step: the mean NLL over
    the whole slice (at most MAX_EVAL_EXAMPLES examples) before and after training.
    """

    examples: list[Example]     # the training set, loaded by run()
    eval_batches: list[Batch]   # what loss_full_before/after are measured on

    async def run(self) -> None:
        """Train `steps` SFT steps. Raises JobStopped (cancel or shutdown) or the error
        that failed the job (ValueError naming sft_data/sft_query for bad data)."""
        await self.start()
        # self.tenant: the job's owner, read by start()
        self.examples = await self.in_engine(load_examples, self.spec, self.settings.home, self.engine.tokenizer,
                                             self.settings.log_dir, self.engine.vocab_size, MAX_TOKENS,
                                             self.tenant)
        log.info("job %s: %d SFT examples, %d loss tokens", self.job_id, len(self.examples),
                 sum(sum(e.loss_mask[1:]) for e in self.examples))
        self.check_live()
        if await self.resume(await checkpoint.get(self.bus, self.job_id)):
            await self.publish_weights()
        elif self.spec.init_from:
            await self.init_from_job()
            await self.publish_weights()
        # loss_full_before/after: the training slice itself (at most MAX_EVAL_EXAMPLES of it)
        n = min(len(self.examples), MAX_EVAL_EXAMPLES)
        measured = [self.examples[i] for i in epoch_order(len(self.examples), self.spec.seed, 0)[:n]]
        self.eval_batches = await self.in_engine(sft_batches, measured, self.spec.micro_batch_size,
                                                 self.engine.pad_id)
        while self.step < self.spec.steps:
            await self.train_sft_step()
        await self.finish()

    def _step_blocking(self, examples: list[Example]) -> dict[str, float]:
        return self.engine.sft_step(sft_batches(examples, self.spec.micro_batch_size, self.engine.pad_id))

    async def train_sft_step(self) -> None:
        """One optimizer step, then weights, checkpoint, metrics and a RUNNING event."""
        t_start = time.monotonic()
        spec, s = self.spec, self.step
        extra: dict[str, float] = {}
        if s == 0:
            extra["loss_full_before"] = (await self.in_engine(self.engine.sft_eval, self.eval_batches))["loss"]
        idx = step_indices(len(self.examples), spec.sft_batch_size, s, spec.seed)
        t0 = time.monotonic()
        out = await self.in_engine(self._step_blocking, [self.examples[i] for i in idx])
        train_s = time.monotonic() - t0
        self.check_live()  # a job cancelled mid-step publishes nothing more
        self.version += 1
        self.step += 1
        await self.publish_weights()
        if self.step == spec.steps:
            extra["loss_full_after"] = (await self.in_engine(self.engine.sft_eval, self.eval_batches))["loss"]
        if self.checkpoint_due():
            await self.save_checkpoint(s, no_stream_meta())
        step_s = time.monotonic() - t_start
        values = {
            "loss": out["loss"], "grad_norm": out["grad_norm"], "tokens": out["tokens"],
            "examples": float(len(idx)), "epoch": (s + 1) * spec.sft_batch_size / len(self.examples),
            "step_time_s": step_s, "train_time_s": train_s, "tokens_per_s": out["tokens"] / max(train_s, 1e-9),
            **extra,
        }
        await self.step_done(s, values)
        log.info("job %s SFT step %d: loss %.4f grad_norm %.4f, %d tokens (%.1f s)%s", self.job_id, s,
                 out["loss"], out["grad_norm"], out["tokens"], train_s,
                 "".join(f", {k} {v:.4f}" for k, v in extra.items()))
