"""Upstream OpenTinker's `opentinker.environment.android_world` is not ported: its
AndroidWorldGame drives a live Android emulator (AndroidWorld, Rawles et al. 2024,
arXiv 2405.14573: an AVD started with -grpc 8554, AndroidEnv and ADB), which this
project has no way to run or test. Importing it raises ImportError saying so, rather
than "No module named" (docs/opentinker-client.md, "Not here yet").
"""

raise ImportError(
    "opentinker.environment.android_world (upstream's AndroidWorldGame) is not part of this package: it drives a "
    "live Android emulator (AndroidWorld, arXiv 2405.14573) that this project cannot run or test. For a household "
    "agent task, use opentinker.environment.alfworld.ALFWorldGame (docs/opentinker-client.md)", name=__name__)
