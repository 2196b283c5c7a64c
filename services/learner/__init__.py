"""The learner service: a job's training state (DeepSpeed) and its GRPO loop.

service.py (the loop), loss.py (GRPO objective), batching.py (trajectories -> tensors),
checkpoint.py (save/resume), engine_deepspeed.py (the only module importing deepspeed).
"""

import os

# OpenMP threads that spin while waiting are catastrophic on a shared CPU: measured on
# this 2-core machine under load, SmolLM2 forward+backward of 8 x 100 tokens took 25 s
# spinning and 1.2-2 s passive. libgomp reads this once, when torch loads, so it is set
# here, before any learner module imports torch. An explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
