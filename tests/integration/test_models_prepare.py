"""`opentinker models prepare` (the README's first command runs it) converts the default
model in its own process; what torch caches on the way goes under the project home,
not into the system's temporary folder (it made an empty /tmp/torchinductor_<user>)."""

import os
import subprocess
import sys
from pathlib import Path

CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "HF_HOME",
              "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS")


def test_models_prepare_converts_into_the_home_and_leaves_no_cache_in_tmp(tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}  # as a user's shell has them
    env.update(OPENTINKER_HOME=str(home), TMPDIR=str(tmp))
    out = subprocess.run([sys.executable, "-m", "opentinker.cli", "models", "prepare"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    model = Path(out.stdout.strip().splitlines()[-1])
    assert model.is_relative_to(home) and (model / "config.json").is_file(), out.stdout
    assert sorted(p.name for p in tmp.iterdir()) == [], out.stderr[-2000:]
