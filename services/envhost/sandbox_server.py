"""`opentinker sandbox`: a code sandbox for environments that run on the user's own
machine, over HTTP: SandboxFusion's `/run_code` contract (github.com/bytedance/SandboxFusion),
which upstream OpenTinker's CodeInterpreterMathGame calls (its default `sandbox_url` is
http://localhost:8000/run_code), served with this project's bubblewrap sandbox
(sandbox.py: no network, no host files, rlimits, a wall clock).

    POST /run_code {"code": str, "language": "python", "run_timeout": seconds (optional)}
      -> {"status": "Success" | "Failed", "message": "",
          "run_result": {"status": "Finished" | "TimeLimitExceeded", "stdout": str,
                         "stderr": "", "return_code": int | None, "execution_time": s}}
    GET /health -> {"status": "ok"}

`stdout` is the run's output (stdout and stderr interleaved, cut to the limits'
`max_output_chars`, then how the run ended when not normally: RunResult.observation).
`run_timeout` can only shorten the server's `timeout_s`. Code over MAX_CODE_BYTES, or
another language, is refused with 422 naming the field. At most one run per core at a
time; the others wait.

It has no authentication, so it listens on a loopback address only (the caller's
game runs on the same machine); any other host is refused. A request naming another
Host (a web page's DNS rebinding) gets 400, and a body not sent as JSON is not read as
one (FastAPI), so a page in the user's browser cannot submit code either.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import threading
from typing import Any

from pydantic import BaseModel

from opentinker.services.envhost.sandbox import SandboxLimits, check, run_python

MAX_CODE_BYTES = 100_000
DEFAULT_PORT = 8000  # upstream's CodeInterpreterMathGame default


class RunCode(BaseModel):
    """The body of POST /run_code."""

    code: str
    language: str = "python"
    run_timeout: float | None = None


def check_loopback(host: str) -> str:
    """`host` when it is a loopback address (or "localhost"); else ValueError."""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"host: {host!r} is not a loopback address; the sandbox server has no authentication, "
                         "so it listens on 127.0.0.1 or ::1 only")
    return host


def make_app(limits: SandboxLimits = SandboxLimits()) -> Any:
    """The FastAPI app. Raises SandboxUnavailable when bwrap cannot make a sandbox here."""
    from fastapi import FastAPI, HTTPException
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    check()
    slots = threading.BoundedSemaphore(os.cpu_count() or 1)
    app = FastAPI(title="OpenTinker sandbox", description=__doc__)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=["127.0.0.1", "localhost", "[::1]", "::1"])

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/run_code")
    def run_code(req: RunCode) -> dict[str, Any]:  # a plain def: FastAPI runs it in its thread pool
        if req.language.lower() not in ("python", "python3"):
            raise HTTPException(422, f"language: {req.language!r} is not served here (python only)")
        if len(req.code.encode()) > MAX_CODE_BYTES:
            raise HTTPException(422, f"code: {len(req.code.encode())} bytes, over {MAX_CODE_BYTES}")
        lim = limits
        if req.run_timeout is not None:
            if not req.run_timeout > 0:
                raise HTTPException(422, f"run_timeout: {req.run_timeout!r} is not a positive number of seconds")
            lim = dataclasses.replace(limits, timeout_s=min(float(req.run_timeout), limits.timeout_s))
        with slots:
            res = run_python(req.code, lim)
        ok = not res.timed_out and res.exit_code == 0
        return {"status": "Success" if ok else "Failed", "message": "",
                "run_result": {"status": "TimeLimitExceeded" if res.timed_out else "Finished",
                               "stdout": res.observation(), "stderr": "", "return_code": res.exit_code,
                               "execution_time": round(res.duration_s, 3)}}

    return app


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, limits: SandboxLimits = SandboxLimits()) -> None:
    """Serve until interrupted. Raises ValueError for a non-loopback host."""
    import uvicorn

    uvicorn.run(make_app(limits), host=check_loopback(host), port=port, log_level="warning")
