#!/usr/bin/env bash
# The README's main command: install, start the embedded stack (local NATS + every
# service as its own process), train SmolLM2-135M-Instruct with LoRA by GRPO on the
# default task, then print the per-step mean reward from the Parquet log with DuckDB.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OPENTINKER_HOME="${OPENTINKER_HOME:-$PWD/.opentinker}"
export DS_ACCELERATOR=cpu
CONFIG="${1:-examples/arith_grpo.toml}"
JOB="arith-$(date +%Y%m%d-%H%M%S)"
.venv/bin/opentinker models prepare
.venv/bin/opentinker train "$CONFIG" --up --job-id "$JOB"
# the episodes each step trained on (`steps`): after a resume, a redone step's are the
# resumed run's only, not the lost run's as well (docs/observability.md)
.venv/bin/opentinker query "SELECT step, round(avg(reward), 3) AS mean_reward, count(*) AS episodes
  FROM trajectories JOIN steps USING (job_id, step, request_id)
  WHERE job_id = '$JOB' AND split = 'train' GROUP BY step ORDER BY step"
