"""Upstream OpenTinker's client lifecycle manager at its import path
(opentinker/client/utils/scheduler_client_lifecycle.py): the job a script registers is
ended when the script exits, normally, by an exception, or on SIGINT / SIGTERM.

    lifecycle = get_lifecycle_manager()
    lifecycle.register_job(scheduler_client, job_id)

Ending a job: one already over (completed, failed, cancelled) is left as it is; an
inference job still serving is completed (its endpoint is freed); any other job is
cancelled. Upstream's `start_reward_server` is refused: the reward here is what the
game's `step()` returns, computed in the caller's process.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("opentinker.client")

_OVER = ("COMPLETED", "FAILED", "CANCELLED")


class SchedulerClientLifecycleManager:
    """Ends the registered job (and runs the cleanup callbacks) at exit or on a signal."""

    def __init__(self) -> None:
        self._scheduler_client: Any = None
        self._current_job_id: str | None = None
        self._cleanup_callbacks: list[Callable[[], Any]] = []
        self._signal_handlers_registered = False

    def start_reward_server(self, *args: Any, **kwargs: Any) -> tuple[Any, int]:
        """Raises NotImplementedError: there is no reward server to start here."""
        raise NotImplementedError("no reward server here: the reward is what the game's step() returns")

    def register_job(self, scheduler_client: Any, job_id: str) -> None:
        """End `job_id` through `scheduler_client` at exit (the last job registered)."""
        self._scheduler_client = scheduler_client
        self._current_job_id = job_id

    def add_cleanup_callback(self, callback: Callable[[], Any]) -> None:
        """Call `callback()` at exit, before the job is ended."""
        self._cleanup_callbacks.append(callback)

    def _cleanup_job(self) -> None:
        client, job_id = self._scheduler_client, self._current_job_id
        self._current_job_id = None
        if client is None or not job_id:
            return
        try:
            status = client.get_job_status(job_id)
            if str(status.get("status", "")).upper() in _OVER:
                return
            if status.get("kind") == "inference":
                result = client.complete_job(job_id)
            else:
                result = client.cancel_job(job_id)
            print(f"✓ Job {job_id} {str(result.get('status', '')).lower()}: {result.get('message', '')}")
        except Exception as e:  # at exit: report it, never raise from cleanup
            print(f"⚠ Could not end job {job_id}: {e}")

    def _cleanup_all(self) -> None:
        for callback in self._cleanup_callbacks:
            try:
                callback()
            except Exception as e:  # at exit: report each callback's failure and go on
                print(f"⚠ Cleanup callback failed: {e}")
        self._cleanup_callbacks.clear()
        self._cleanup_job()

    def _signal_handler(self, signum: int, frame: Any) -> None:
        print(f"\n⚠️  Received {signal.Signals(signum).name} - ending the job and exiting")
        self._cleanup_all()
        sys.exit(0)

    def enable_auto_cleanup(self) -> None:
        """Clean up at exit and on SIGINT / SIGTERM (the latter only from the main thread)."""
        if self._signal_handlers_registered:
            return
        atexit.register(self._cleanup_all)
        try:
            signal.signal(signal.SIGINT, self._signal_handler)
            signal.signal(signal.SIGTERM, self._signal_handler)
        except ValueError:  # not the main thread: atexit only
            log.info("lifecycle: not in the main thread; the job is ended at exit only")
        self._signal_handlers_registered = True


_manager: SchedulerClientLifecycleManager | None = None


def get_lifecycle_manager() -> SchedulerClientLifecycleManager:
    """The process's manager, created (with auto cleanup enabled) on first use."""
    global _manager
    if _manager is None:
        _manager = SchedulerClientLifecycleManager()
        _manager.enable_auto_cleanup()
    return _manager
