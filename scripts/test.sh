#!/usr/bin/env bash
# The README's test command: install, then run the test suite (real nats-server,
# real engines on a tiny model). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export OPENTINKER_HOME="${OPENTINKER_HOME:-$PWD/.opentinker}"
export DS_ACCELERATOR=cpu
# lint first (ruff, [tool.ruff] in pyproject.toml): a lint error fails the run before the long suite
.venv/bin/ruff check .
# two workers (pytest-xdist): one process leaves a core idle while a test waits on its
# services; two keep both busy (19 min of pytest at 1dd49d3; 37-39 min in one process,
# measured earlier). A file (tests/adversarial: the folder) runs whole on one worker
# (tests/conftest.py). `-n 0` runs in one process.
# the slowest tests are listed at the end (--durations): where the suite's time goes
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --timeout 900 --durations=25 "$@"
