"""A job's DeepSpeed config, pure (no deepspeed import): engine_deepspeed.py passes it to
deepspeed.initialize."""

from __future__ import annotations

from opentinker.schemas import JobSpec


def deepspeed_config(spec: JobSpec, world_size: int, dtype: str) -> dict:
    """The DeepSpeed config of a job's engine on `world_size` data-parallel ranks;
    `dtype` is the learner's resolved dtype ("float32" or "bfloat16").

    Micro-batches accumulate over a variable count, with the boundary set by hand
    (train_step), so DeepSpeed's own accumulation count is 1. In bfloat16, gradients
    accumulate in float32 (`"data_types": {"grad_accum_dtype": "fp32"}`, DeepSpeed's
    config docs): summed in bfloat16, every micro-batch's addition rounds the sum to
    8 significant bits. DeepSpeed (0.19) accumulates a bfloat16 model's gradients in
    float32 only under ZeRO (stage 1: its BF16_Optimizer; 2 and 3: the ZeRO
    optimizer's float32 buffers) and refuses the mix without it (NotImplementedError,
    engine._do_optimizer_sanity_check), so a bfloat16 job of zero_stage 0 runs at
    stage 1: the same update (float32 master weights, optimizer state and gradient
    sums), its optimizer state split over the ranks (nothing to split on one rank).
    A tinker session keeps stage 0 (it accumulates in .grad across calls) and with
    it bfloat16 sums.
    """
    bf16 = dtype == "bfloat16"
    stage = max(spec.zero_stage, 1) if bf16 and spec.algorithm != "tinker" else spec.zero_stage
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": spec.micro_batch_size * world_size,
        # a tinker session clips by each optim_step's own grad_clip_norm (tinker_optim_step)
        "gradient_clipping": 0.0 if spec.algorithm == "tinker" else spec.max_grad_norm,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16 and stage > 0:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config
