"""Run one of upstream OpenTinker's client scripts unchanged (`opentinker upstream`):

    opentinker upstream opentinker/client/math_rl.py tokenizer_path=Qwen/Qwen2.5-1.5B data_path=...

Upstream's scripts live in its `opentinker/client/` folder and import their helpers as
`utils.http_training_client`, `utils.utils` and `utils.scheduler_client_lifecycle`:
that folder's own `utils` package, which drives upstream's per-job verl server. This
runs SCRIPT as `__main__`, as `python SCRIPT ARGS` would (its folder first on
sys.path, sys.argv = [SCRIPT, *ARGS]), with `utils` bound to `opentinker.client.utils`,
so those imports reach this service. As with `python SCRIPT`, the current directory is
not put on sys.path, so an upstream checkout's own `opentinker/` folder (where such
scripts usually sit) does not shadow this package. Hydra finds the script's `client_config/` beside
it as usual, and the arguments are hydra overrides. The scheduler URL and key: the
config's `scheduler_url` / `scheduler_api_key`, else $OPENTINKER_API_URL /
$OPENTINKER_API_KEY (docs/opentinker-client.md).

Hydra sets the root logger to INFO, and httpx logs every request at INFO, so each of
the client's status polls would print a line: httpx's logger is set to WARNING here
unless something already set its level.
"""

from __future__ import annotations

import importlib
import logging
import runpy
import sys
from pathlib import Path

#: the top-level modules of the `upstream` extra (pyproject.toml)
UPSTREAM_EXTRA = ("hydra", "omegaconf", "math_verify", "pyarrow")
#: upstream's `utils.<name>` modules, bound to opentinker.client.utils.<name>
UTILS_MODULES = ("http_training_client", "utils", "scheduler_client_lifecycle", "config")


def bind_utils() -> None:
    """Make `import utils.<name>` (and `from utils.<name> import ...`) load this package's
    modules, whatever `utils` folder the script's own directory holds."""
    sys.modules["utils"] = importlib.import_module("opentinker.client.utils")
    for name in UTILS_MODULES:
        sys.modules[f"utils.{name}"] = importlib.import_module(f"opentinker.client.utils.{name}")


def main(argv: list[str] | None = None) -> int:
    """Run SCRIPT with its arguments; returns the exit status (2 for a missing script)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n", 1)[1])
        return 0 if args else 2
    script = Path(args[0])
    if not script.is_file():
        print(f"error: {script}: no such script", file=sys.stderr)
        return 2
    bind_utils()
    if logging.getLogger("httpx").level == logging.NOTSET:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    sys.argv = [str(script), *args[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in UPSTREAM_EXTRA:
            print(f"error: {script} imports {e.name!r}: pip install 'opentinker[upstream]'", file=sys.stderr)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
