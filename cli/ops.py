"""The operator's commands (opentinker.ops; they need the `server` extra): `up`,
`serve NAME`, `envhost`, `serve-model`, `data gsm8k`, `models prepare`, `nats-keys DIR`."""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

from opentinker.cli.common import home
from opentinker.ops.stack import SERVICES
# Commands whose arguments all pass through to another parser (cli/main.py splits them off).
PASSTHROUGH = ("serve-model", "envhost", "upstream")


def cmd_up(args: argparse.Namespace) -> int:
    from opentinker.ops.stack import Stack, supervise

    services = tuple(s for s in SERVICES if s not in args.without)
    try:
        stack = Stack(home(), nats_url=os.environ.get("NATS_URL") or None, services=services,
                      cluster=args.cluster, rollout_workers=args.rollout_workers).start()
    except ValueError as e:
        raise SystemExit(f"opentinker up: {e}") from None
    where = stack.home / ("nats-cluster" if stack.cluster else "nats")
    print(f"OpenTinker up: NATS {stack.nats_url} (JetStream in {where}"
          + (f", {stack.cluster} nodes, {min(stack.cluster, 3)} replicas)" if stack.cluster else ")"))
    if stack.api_url:
        print(f"  REST API and dashboard {stack.api_url} (admin key in {stack.home / 'admin.key'})")
    if stack.tinker_url:
        print(f"  Tinker API {stack.tinker_url} (TINKER_BASE_URL; TINKER_API_KEY=tml-<your API key>)")
    for name, p in stack.procs.items():
        print(f"  {name:<10} pid {p.pid:<8} log {stack.log_dir / (name + '.log')}")
    print("Ctrl-C stops everything.", flush=True)
    supervise(stack)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    importlib.import_module(f"opentinker.services.{args.name}.service").main(args.rest)
    return 0


def cmd_envhost(args: argparse.Namespace) -> int:
    from opentinker.services.envhost.service import main

    main(args.rest)
    return 0


def cmd_sandbox(args: argparse.Namespace) -> int:
    from opentinker.services.envhost.sandbox import SandboxLimits
    from opentinker.services.envhost.sandbox_server import check_loopback, serve

    try:
        host = check_loopback(args.host)
        limits = SandboxLimits(timeout_s=args.timeout_s, memory_mb=args.memory_mb)
    except ValueError as e:
        raise SystemExit(f"opentinker sandbox: {e}") from None
    print(f"sandbox on http://{host}:{args.port}/run_code (SandboxFusion's contract; Ctrl-C stops it)", flush=True)
    serve(host, args.port, limits)
    return 0


def cmd_serve_model(args: argparse.Namespace) -> int:
    from opentinker.ops.serve_model import main

    return main(args.rest)


def cmd_data(args: argparse.Namespace) -> int:
    from opentinker.services.envhost.envs.gsm8k import prepare_gsm8k

    out = args.out or str(Path(home()) / "data" / "gsm8k")
    for split, n in prepare_gsm8k(args.src, out).items():
        print(f"{split}: {n} problems -> {out}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from opentinker.services.core.config import setup_cache_dirs

    # the conversion imports torch in this process: its caches into the project home,
    # as every service's (torch's inductor otherwise makes /tmp/torchinductor_<user>)
    setup_cache_dirs(home())
    from opentinker.services.core.models import resolve_model

    print(resolve_model(args.model, home()))
    return 0


def cmd_nats_keys(args: argparse.Namespace) -> int:
    from opentinker.ops.keys import write_nats_keys

    write_nats_keys(Path(args.dir))
    return 0


def register(sub) -> None:
    s = sub.add_parser("up", help="start a local NATS server and every service")
    s.add_argument("--without", nargs="*", default=[], choices=SERVICES, help="services not to start")
    s.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="run N (3 or more) nats-servers as one cluster, streams replicated on 3 of them")
    s.add_argument("--rollout-workers", type=int, default=1, metavar="N",
                   help="start N rollout workers (a job takes `rollout_workers` of them)")
    s.set_defaults(fn=cmd_up)

    s = sub.add_parser("serve", help="run one service in the foreground")
    s.add_argument("name", choices=SERVICES)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("envhost", help="serve environments (built-in, or --env module:Class)")
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_envhost)

    s = sub.add_parser("serve-model", help="serve a model plus a trained adapter or checkpoint "
                                           "(OpenAI API, vLLM)", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_serve_model)

    s = sub.add_parser("sandbox", help="serve a Python sandbox on loopback for envs on your machine "
                                       "(SandboxFusion's /run_code, as upstream's CodeInterpreterMathGame calls)")
    s.add_argument("--host", default="127.0.0.1", help="a loopback address (no authentication)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--timeout-s", type=float, default=10.0, help="wall clock per run")
    s.add_argument("--memory-mb", type=int, default=1024, help="address space per process")
    s.set_defaults(fn=cmd_sandbox)

    s = sub.add_parser("data", help="prepare a dataset")
    s.add_argument("dataset", choices=["gsm8k"])
    s.add_argument("--src", required=True, help="folder with train.jsonl and test.jsonl")
    s.add_argument("--out", help="output folder (default <home>/data/gsm8k)")
    s.set_defaults(fn=cmd_data)

    s = sub.add_parser("nats-keys", help="make a deployment's NATS keys and auth config (compose/)")
    s.add_argument("dir", help="where to write service.nk, callout-issuer.nk, callout.xk, system.nk and auth.conf")
    s.set_defaults(fn=cmd_nats_keys)

    s = sub.add_parser("models", help="model utilities")
    s.add_argument("action", choices=["prepare"])
    s.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    s.set_defaults(fn=cmd_models)
