"""Running the official `tinker` SDK, unchanged, as a user would configure it."""

from __future__ import annotations

import os
from typing import Any, Callable


def run_sdk(base_url: str, key: str, fn: Callable[[Any], Any]) -> Any:
    """Run `fn(service_client)` with the SDK configured by environment variables only
    (TINKER_BASE_URL, TINKER_API_KEY = `key`, telemetry off); returns what `fn` returns."""
    import tinker

    env = {"TINKER_BASE_URL": base_url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tinker.ServiceClient() as sc:
            return fn(sc)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
