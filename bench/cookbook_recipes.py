"""tinker-cookbook's recipes, unchanged, with their own default losses, against
`opentinker up`: rl_loop (stable_reinforce), math_rl (stable_reinforce, its `arithmetic`
env) and on-policy distillation (importance_sampling, a teacher's compute_logprobs), a
few steps each with small batches on SmolLM2-135M-Instruct, every HTTP call the SDK makes
recorded (bench/cookbook_runner.py). What a run should show: every call answered without
error (no status >= 400, no failed future, no call unanswered), each recipe exiting 0,
and rl_loop (copy task), math_rl and the distillation each sending forward_backward with
their loss, every datum with provenance.

rl_loop runs twice. On GSM8K (`rl_loop`), as shipped, SmolLM2-135M almost never writes
its answer in \\boxed{} (rl_loop's reward needs it: 0 of 96 samples in one run, 1 in
the next), so its groups' rewards are mostly all equal and rl_loop skips those training
steps: its loss may not run at all. `rl_loop_copy` gives it a local file
in GSM8K's format whose questions ask to copy an answer ("Copy this answer:
\\boxed{17}"), which the model does now and then (1 of 8), so groups differ and rl_loop's
own stable_reinforce step runs.

    .venv/bin/python bench/cookbook_recipes.py --gsm8k DIR   # a folder with GSM8K's train.jsonl and test.jsonl
    .venv/bin/python bench/cookbook_recipes.py --gsm8k DIR --only rl_loop --steps 2 --out /tmp/x.json

How: the cookbook (tinker-cookbook==0.6.1) goes into its own virtualenv,
`<home>/cookbook-venv-0.6.1`, made once; the project's is not touched. It is installed
with `--no-deps`, then its requirements and its `math-rl` extra (math_rl's and rl_loop's
grading) with tinker==0.38.0 and torch==2.13.0 pinned in the same pip command (pip then
takes the CPU build; the wheel folders of scripts/install.sh are searched too), all but
tml-renderers: the cookbook asks for >= 0.4.1, which this machine's registry does not
have (0.2.1 is its newest), and imports it only for Inkling models and the audio
recipes. `opentinker up` runs on a fresh home under
`<home>/bench/` (its own NATS store and logs); the recipes use its admin key (in their
environment, never on a command line), the model's local folder as `model_name`, the
cookbook's generic `role_colon` renderer (the cookbook has none for SmolLM2: passed as
`renderer_name=` where a recipe takes one, else by the runner), HF_HUB_OFFLINE=1, and
GSM8K from `--gsm8k` for every dataset they load. Each saves a checkpoint at step 2
(`save_every=2`) so that its save's ttl_seconds is exercised. The distillation's LoRA rank
is 32 as the others' (its default, 128, makes each sampler save a 156 MB adapter; on this
2-core machine under load the learner then once missed its pool heartbeat and lost the
session). The stack is stopped by its process id at the end.

Writes bench/results/<date>_<commit>_cookbook.json (default `--out`): provenance, the
arguments, and per recipe its exit code, wall seconds, the calls by route and status,
every call that failed, the forward_backward calls by loss_fn (with how many datums carried
provenance), and the last lines of its output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
COOKBOOK = "tinker-cookbook==0.6.1"
PINS = ("tinker==0.38.0", "torch==2.13.0")
EXTRAS = ("math-rl",)
LEFT_OUT = ("tml-renderers",)  # module docstring
# run name -> (recipe, its data: "gsm8k" or "copy")
RUNS = {"rl_loop": ("rl_loop", "gsm8k"), "rl_loop_copy": ("rl_loop", "copy"), "math_rl": ("math_rl", "gsm8k"),
        "on_policy_distillation": ("on_policy_distillation", "gsm8k")}
RENDERER = "role_colon"


def recipe_args(recipe: str, model: str, steps: int, log_dir: Path) -> list[str]:
    """The recipe's command line: its defaults, but for the model, small batches, `steps`
    steps, a fresh log folder and a save at step 2."""
    common = [f"model_name={model}", f"log_path={log_dir}", f"max_steps={steps}", "save_every=2"]
    if recipe == "rl_loop":
        return [*common, "batch_size=2"]
    if recipe == "math_rl":
        return [*common, f"renderer_name={RENDERER}", "groups_per_batch=4", "behavior_if_log_dir_exists=delete"]
    return [*common, f"teacher_model={model}", f"renderer_name={RENDERER}", "groups_per_batch=2", "max_tokens=64",
            "lora_rank=32", "behavior_if_log_dir_exists=delete"]


def copy_task(folder: Path, n_train: int = 512, n_test: int = 64) -> Path:
    """`folder` with train.jsonl and test.jsonl in GSM8K's format ({"question", "answer"
    ending "#### <n>"}) whose questions ask to copy a boxed number (module docstring)."""
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        rows = [rng.randrange(100) for _ in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": f"Copy this answer: \\boxed{{{x}}}", "answer": f"The answer is {x}.\n#### {x}"})
            + "\n" for x in rows))
    return folder


def ensure_venv(venv: Path) -> Path:
    """The cookbook's virtualenv at `venv` (made and installed once). Returns its python.
    Raises RuntimeError when pip fails or torch is not 2.13.0 on CPU."""
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        links = [a for d in (*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels") if os.path.isdir(d)
                 for a in ("--find-links", d)]

        def pip(*args: str) -> None:
            r = subprocess.run([str(python), "-m", "pip", "install", "-q", *links, *args], capture_output=True,
                               text=True)
            if r.returncode != 0:
                raise RuntimeError(f"pip install {' '.join(args)[:300]}: {r.stderr[-2000:]}")

        pip("--no-deps", COOKBOOK)
        r = subprocess.run([str(python), "-c", REQUIREMENTS, ",".join(EXTRAS), ",".join(LEFT_OUT)],
                           capture_output=True, text=True, check=True)
        pip(*r.stdout.split("\n")[:-1], *PINS)
        (venv / ".installed").write_text(f"{COOKBOOK} {' '.join(PINS)}\n")
    r = subprocess.run([str(python), "-c", "import torch, tinker, tinker_cookbook; print(torch.__version__, "
                        "torch.version.cuda, tinker.__version__)"], capture_output=True, text=True)
    got = r.stdout.split()
    if r.returncode != 0 or got[:2] != ["2.13.0+cpu", "None"]:
        raise RuntimeError(f"{venv}: torch 2.13.0+cpu expected, got {r.stdout.strip()} {r.stderr[-500:]}")
    return python


# run in the cookbook's venv: its requirements, with the extras named in argv[1] and
# without the distributions named in argv[2], one per line
REQUIREMENTS = """
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
extras, out = set(sys.argv[1].split(",")), set(sys.argv[2].split(","))
for line in requires("tinker-cookbook"):
    r = Requirement(line)
    if r.name in out or (r.marker and not any(r.marker.evaluate({"extra": e}) for e in extras | {""})):
        continue
    r.marker = None
    print(r)
"""


def start_stack(home: Path, timeout_s: float = 300) -> tuple[subprocess.Popen, str, str]:
    """`opentinker up` on `home`. Returns (its process, the Tinker API's URL, the admin
    key). Raises RuntimeError if it does not answer within `timeout_s`."""
    import httpx

    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OPENTINKER_HOME=str(home))
    env.pop("NATS_URL", None)
    log = open(home / "up.log", "ab")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "opentinker"), "up"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"opentinker up exited ({proc.returncode}); see {home / 'up.log'}")
        stack = home / "stack.json"
        if stack.exists():
            url = json.loads(stack.read_text()).get("tinker_url", "")
            try:
                if url and httpx.get(url + "/api/v1/healthz", timeout=2).status_code == 200:
                    return proc, url, (home / "admin.key").read_text().strip()
            except httpx.HTTPError:
                pass
        time.sleep(1)
    stop_stack(proc)
    raise RuntimeError(f"the Tinker API did not answer within {timeout_s:.0f} s; see {home / 'logs'}")


def stop_stack(proc: subprocess.Popen) -> None:
    """Stop `opentinker up` (SIGINT: it stops its services in order) by its process id."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def summarize(calls: list[dict]) -> dict:
    """Calls by route and status, the failed ones, and forward(_backward)s by loss_fn."""
    by_route = Counter(f"{c['method']} {_route(c['path'])} {c['status']}" for c in calls)
    failed = [c for c in calls if c["status"] is None or c["status"] >= 400 or c.get("future_error")]
    losses: dict[str, dict[str, int]] = {}
    for c in calls:
        if "loss_fn" in c and c["status"] == 200:
            d = losses.setdefault(c["loss_fn"], {"calls": 0, "datums": 0, "with_provenance": 0})
            d["calls"] += 1
            d["datums"] += c["datums"]
            d["with_provenance"] += c["with_provenance"]
    return {"calls": len(calls), "by_route": dict(sorted(by_route.items())), "failed": failed,
            "forward_backward": losses}


def _route(path: str) -> str:
    """A path with its ids replaced (`/api/v1/training_runs/{id}`), so calls group by route."""
    return "/".join(p if re.fullmatch(r"[a-z_]*|v1", p) else "{id}" for p in path.split("/"))


def run_recipe(python: Path, name: str, data: Path, model: str, steps: int, scratch: Path, env: dict,
               timeout_s: float) -> dict:
    """Run `name` of RUNS through bench/cookbook_runner.py on the GSM8K-format folder
    `data`: its record (module docstring)."""
    recipe = RUNS[name][0]
    calls_path = scratch / f"{name}.calls.jsonl"
    calls_path.unlink(missing_ok=True)
    cmd = [str(python), str(BENCH / "cookbook_runner.py"), recipe, str(calls_path),
           *recipe_args(recipe, model, steps, scratch / "runs" / name)]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, env={**env, "GSM8K_DIR": str(data)}, capture_output=True, text=True,
                           timeout=timeout_s, cwd=scratch)
        rc, output = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, output = None, f"timed out after {timeout_s:.0f} s\n" + (e.stdout or b"").decode(errors="replace")
    (scratch / f"{name}.log").write_text(output)
    calls = [json.loads(line) for line in calls_path.read_text().splitlines()] if calls_path.exists() else []
    return {"recipe": name, "data": RUNS[name][1], "args": cmd[4:], "returncode": rc,
            "wall_s": round(time.time() - t0, 1), **summarize(calls), "output_tail": output.splitlines()[-15:]}


def report(res: dict) -> str:
    """The results file `res` as a short table (bench/results_page.py shows it)."""
    lines = [f"### {res.get('date', '?')}: {res.get('cookbook', '?')} against `opentinker up` "
             f"(commit {str(res.get('commit', '?'))[:7]}{', uncommitted changes' if res.get('dirty') else ''})\n",
             "| recipe | exit | steps | wall s | HTTP calls | failed | forward_backward (loss: calls, datums "
             "with provenance) |", "|---|---|---|---|---|---|---|"]
    for r in res.get("recipes", []):
        fb = "; ".join(f"{k}: {v['calls']}, {v['with_provenance']}/{v['datums']}"
                       for k, v in r.get("forward_backward", {}).items()) or "none"
        lines.append(f"| {r['recipe']} | {r['returncode']} | {res.get('steps', '?')} | {r['wall_s']} | "
                     f"{r['calls']} | {len(r['failed'])} | {fb} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gsm8k", required=True, help="a folder with GSM8K's train.jsonl and test.jsonl")
    ap.add_argument("--steps", type=int, default=3, help="training steps per recipe (max_steps)")
    ap.add_argument("--only", action="append", choices=RUNS, help="run this one (repeatable; default all)")
    ap.add_argument("--venv", help="the cookbook's virtualenv (default <home>/cookbook-venv-0.6.1)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per recipe")
    ap.add_argument("--out", help="results file (default bench/results/<date>_<commit>_cookbook.json)")
    args = ap.parse_args()
    sys.path.insert(0, str(BENCH))
    from provenance import git, provenance

    from opentinker.services.core.config import default_home
    from opentinker.services.core.models import DEFAULT_MODEL, resolve_model

    gsm8k = Path(args.gsm8k).resolve()
    if not (gsm8k / "train.jsonl").exists() or not (gsm8k / "test.jsonl").exists():
        raise SystemExit(f"--gsm8k: {gsm8k} has no train.jsonl and test.jsonl")
    home = Path(default_home())
    python = ensure_venv(Path(args.venv) if args.venv else home / "cookbook-venv-0.6.1")
    model = resolve_model(DEFAULT_MODEL, str(home))
    record = {**provenance(), "cookbook": COOKBOOK, "pins": list(PINS), "steps": args.steps, "model": model,
              "renderer": RENDERER, "recipes": []}
    scratch = home / "bench" / f"cookbook-{time.strftime('%Y%m%d-%H%M%S')}"
    proc, url, key = start_stack(scratch)
    print(f"opentinker up: Tinker API {url} (home {scratch})", flush=True)
    env = dict(os.environ, TINKER_BASE_URL=url, TINKER_API_KEY=f"tml-{key}", TINKER_TELEMETRY="0",
               COOKBOOK_RENDERER=RENDERER, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HOME=str(scratch / "hf"), WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1")
    env.pop("OPENTINKER_HOME", None)
    out = Path(args.out) if args.out else \
        BENCH / "results" / f"{time.strftime('%Y-%m-%d')}_{git('rev-parse', '--short', 'HEAD')}_cookbook.json"
    try:
        data = {"gsm8k": gsm8k, "copy": copy_task(scratch / "copy_task")}
        for name in args.only or RUNS:
            r = run_recipe(python, name, data[RUNS[name][1]], model, args.steps, scratch, env, args.timeout)
            record["recipes"].append(r)
            out.write_text(json.dumps(record, indent=1) + "\n")  # each recipe's record as soon as it is done
            print(f"{name}: exit {r['returncode']}, {r['wall_s']} s, {r['calls']} HTTP calls, "
                  f"{len(r['failed'])} failed, forward_backward {r['forward_backward']}", flush=True)
    finally:
        stop_stack(proc)
    print(report(record))
    print(f"wrote {out}")
    if any(r["returncode"] != 0 or r["failed"] for r in record["recipes"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
