"""`android-world`: not served in this deployment. AndroidWorld (Rawles et al., 2024,
arXiv 2405.14573; github.com/google-research/android_world) runs its 116 tasks on a
live Android emulator (an AVD of a Pixel 6 on API 33 started with `-grpc 8554`),
driven through AndroidEnv and ADB, with a screen (screenshots and the UI tree) as
each observation. The envhost hosts run no Android emulator (no KVM, no Android SDK),
so a job that names this env fails at once with the reason instead of timing out.
"""

from __future__ import annotations

from typing import Any

from opentinker.environment.base_game import AbstractGame

UNAVAILABLE = (
    "env android-world is not available in this deployment: AndroidWorld (arXiv 2405.14573) needs a "
    "running Android emulator (an Android SDK AVD, Pixel 6 / API 33, started with -grpc 8554, driven "
    "through AndroidEnv and ADB, which needs KVM), and the envhost hosts have none. For a household "
    "agent task that runs here, use the text env alfworld.")


class AndroidWorldGame(AbstractGame):
    """A placeholder that names why AndroidWorld cannot run here.

    Raises RuntimeError (UNAVAILABLE) on construction, so the envhost answers the job's
    first request with that error.
    """

    name = "android-world"

    def __init__(self, **env_args: Any):
        raise RuntimeError(UNAVAILABLE)
