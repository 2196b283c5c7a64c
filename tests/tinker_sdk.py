"""Running the official `tinker` SDK, unchanged, as a user would configure it; a stack
with the Tinker API, its tenants, and a Datum in Tinker's alignment."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable


@contextlib.contextmanager
def _sdk_env(base_url: str, key: str):
    """TINKER_BASE_URL, TINKER_API_KEY = `key` and telemetry off, for the block's length."""
    env = {"TINKER_BASE_URL": base_url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_sdk(base_url: str, key: str, fn: Callable[[Any], Any]) -> Any:
    """Run `fn(service_client)` with the SDK configured by environment variables only
    (TINKER_BASE_URL, TINKER_API_KEY = `key`, telemetry off); returns what `fn` returns."""
    import tinker

    with _sdk_env(base_url, key), tinker.ServiceClient() as sc:
        return fn(sc)


def run_rest(base_url: str, key: str, fn: Callable[[Any], Any]) -> Any:
    """Run `fn(rest_client)` with a `tinker.RestClient` of `key` (the SDK's REST-only
    client: no session; given its URL and key outright, since the SDK keeps one client
    per URL and key for the life of the process); returns what `fn` returns."""
    import tinker

    with _sdk_env(base_url, key):
        return fn(tinker.RestClient(base_url=base_url, api_key=key))


def datum(tokens: list[int], **inputs) -> Any:
    """A tinker.Datum in Tinker's next-token alignment: position i of the input predicts
    tokens[i + 1]; `inputs` are further loss_fn_inputs (weights, logprobs, advantages)."""
    import numpy as np
    import tinker

    arrays = {"target_tokens": np.array(tokens[1:], dtype=np.int64)}
    arrays.update({k: np.asarray(v, dtype=np.float32) for k, v in inputs.items()})
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={k: tinker.TensorData.from_numpy(v) for k, v in arrays.items()})


async def start_stack(services, *tinker_args: str) -> str:
    """The services (scheduler, learner, an hf rollout worker) and the tinker service
    with `tinker_args`, started by `services`; the tinker service's base URL once healthy."""
    from opentinker.services.core.nats_server import free_port
    from tenants import wait_http_ok

    port = free_port()
    for name in ("scheduler", "learner"):
        services.start(name)
    services.start("rollout", "engine=hf")
    services.start("tinker", f"tinker_port={port}", *tinker_args)
    base = f"http://127.0.0.1:{port}"
    await wait_http_ok(base + "/api/v1/healthz")
    return base


async def tenants(bus, job_id: str) -> dict[str, str]:
    """alice and bob, users of the test's own: {who: key}."""
    from opentinker.services.core.users import Users

    users = Users(bus)
    keys = {}
    for who in ("alice", "bob"):
        name = f"{who}-{job_id[-6:]}"
        await users.create_user(name)
        keys[who] = "tml-" + (await users.create_key(name))[1]
    return keys
