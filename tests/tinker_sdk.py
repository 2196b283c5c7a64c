"""Running the official `tinker` SDK, unchanged, as a user would configure it."""

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
