"""The learner service: a job's training state (DeepSpeed) and its training loop.

    service.py          a learner worker: assignments in, one job run at a time
    lifecycle.py        what every job run shares: start, event follower, fencing,
                        weights, checkpoints, finish (RunLifecycle)
    job.py              a GRPO run (JobRun): ask for groups, wait, train a step, publish
    step.py             a GRPO step planned from its trajectories, pure: reward bonuses,
                        advantages, updates, micro-batches, learning rates
    ledger.py           trajectory bookkeeping, pure: held groups, duplicates, attempts,
                        the stream floor a checkpoint resumes from
    sft.py              an SFT run (SFTRun): a dataset file or a query over the log
    evaluation.py       periodic evaluation episodes and their metrics
    loss.py             the GRPO objective and turn-level credit
    ds_config.py        a job's DeepSpeed config (ZeRO stage, precision, accumulation)
    batching.py         trajectories -> padded tensors and advantages
    checkpoint.py       save / resume through the object store
    engine_deepspeed.py the only module importing deepspeed
    ranks.py            learner_ranks > 1: the engine as N data-parallel ranks,
                        fed by the service (RankGroup)
    process_group.py    the torch.distributed group, with no listening socket
"""

import os

# OpenMP threads that spin while waiting are catastrophic on a shared CPU: measured on
# this 2-core machine under load, SmolLM2 forward+backward of 8 x 100 tokens took 25 s
# spinning and 1.2-2 s passive. libgomp reads this once, when torch loads, so it is set
# here, before any learner module imports torch. An explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
