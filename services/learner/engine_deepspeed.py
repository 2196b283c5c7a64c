"""The policy under training: a transformers causal LM (LoRA via peft, or every
parameter) wrapped in a DeepSpeed engine. The only module that imports deepspeed.

One process, world size 1 (gloo on CPU, nccl on CUDA); ZeRO stage from the job spec;
a client torch AdamW optimizer (DeepSpeed's CPU-Adam op would be compiled on first use,
about 80 s on a 2-core CPU machine). Gradients accumulate over micro-batches and the
optimizer steps once per training step.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from opentinker.schemas import JobSpec
from opentinker.services.core import tracing
from opentinker.services.core.nats_server import free_port
from opentinker.services.learner.batching import Batch
from opentinker.services.learner.loss import grpo_loss, token_logprobs

log = logging.getLogger("opentinker.learner.engine")

DS_TAG = "state"


def pick_device(device: str) -> str:
    """"auto" -> "cuda" when a GPU is visible, else "cpu"."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _init_distributed(device: str) -> None:
    """A one-process torch.distributed group, once per process (DeepSpeed needs one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    # the rendezvous address goes in the call, not in os.environ: processes this one
    # starts later (a test's services) would inherit a port it holds
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")


class TrainEngine:
    """A job's policy, optimizer and (when kl_coef > 0) reference policy.

    `model_path` is what `from_pretrained` accepts. Raises whatever transformers/peft
    raise for a bad model path or bad LoRA target modules (the job fails with it).
    """

    def __init__(self, spec: JobSpec, model_path: str, device: str = "auto"):
        device = pick_device(device)
        # DeepSpeed picks its accelerator once, at import; the settings' device decides it
        os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.spec = spec
        self.device = device
        self.kind = "lora" if spec.lora_rank > 0 else "full"
        self.batch_size = spec.episodes_per_step
        self.n_micro = math.ceil(self.batch_size / spec.micro_batch_size)
        dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        model.config.use_cache = False
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

        self.ref_model = None
        if self.kind == "lora":
            from peft import LoraConfig, get_peft_model

            cfg = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                             target_modules=list(spec.lora_target_modules), bias="none",
                             task_type="CAUSAL_LM")
            model = get_peft_model(model, cfg)
        elif spec.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False).to(device)

        _init_distributed(device)
        params = [p for p in model.parameters() if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in params)  # before ZeRO-3 partitions them
        optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
        config = {
            "train_micro_batch_size_per_gpu": spec.micro_batch_size,
            "gradient_accumulation_steps": self.n_micro,
            "train_batch_size": spec.micro_batch_size * self.n_micro,
            "gradient_clipping": spec.max_grad_norm,
            "zero_optimization": {"stage": spec.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": spec.dtype == "bfloat16"},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        log.info("engine ready: %s, %d trainable parameters, ZeRO %d, %d micro-batches/step, %s",
                 self.kind, self.n_trainable, spec.zero_stage, self.n_micro, device)

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (a peft PeftModel for LoRA)."""
        return self.engine.module

    def _gathered(self):
        """All parameters materialized (ZeRO-3 partitions them), else a no-op."""
        if self.spec.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.module.parameters()))
        return nullcontext()

    def _ref_logprobs(self, mb: Batch, temperature: float) -> torch.Tensor:
        with torch.no_grad():
            if self.kind == "lora":
                with self.module.disable_adapter():
                    logits = self.module(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            else:
                logits = self.ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            return token_logprobs(logits, mb.input_ids, temperature)[0]

    def train_step(self, batches: Sequence[Batch]) -> dict[str, float]:
        """One optimizer step over the micro-batches of a training step.

        Each micro-batch's loss is divided by the whole step's policy-token count, so
        the accumulated gradient is that of the per-token mean over the step (DAPO
        arXiv 2503.14476 §3.3). Returns loss, grad_norm (before clipping), entropy,
        clip_frac, approx_kl, kl (to the reference; 0 when kl_coef is 0), tokens. A step
        without policy tokens changes nothing and returns zeros.
        Raises ValueError unless there are exactly as many micro-batches as the engine
        accumulates.
        """
        if len(batches) != self.n_micro:
            # DeepSpeed steps the optimizer on exactly the n_micro-th backward
            raise ValueError(f"{len(batches)} micro-batches; the engine accumulates {self.n_micro}")
        spec = self.spec
        temperature = spec.sampling.temperature or 1.0
        total = float(sum(b.num_tokens for b in batches))
        if total == 0:
            # every episode ended before the policy spoke (errors): nothing to learn, and
            # an AdamW step on zero gradients would still move the weights (momentum)
            return dict(loss=0.0, grad_norm=0.0, entropy=0.0, clip_frac=0.0, approx_kl=0.0, kl=0.0, tokens=0.0)
        sums = dict(loss=0.0, clipped=0.0, approx_kl=0.0, kl=0.0, entropy=0.0)
        self.engine.train()
        grad_norm = 0.0
        for k, mb in enumerate(batches):
            mb = Batch(*(t.to(self.device) for t in mb))
            ref = self._ref_logprobs(mb, temperature) if spec.kl_coef > 0 else None
            with tracing.span("learner.forward_backward", attrs={"ot.micro_batch": k,
                                                                 "ot.tokens": int(mb.input_ids.numel())}):
                logits = self.engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                logp, entropy = token_logprobs(logits, mb.input_ids, temperature)
                del logits
                out = grpo_loss(logp, mb.logprobs, mb.advantages, mb.loss_mask, spec.clip_range,
                                num_tokens=total, logp_ref=ref, kl_coef=spec.kl_coef, entropy=entropy)
                self.engine.backward(out.loss, scale_wrt_gas=False)
            if k == self.n_micro - 1:
                grad_norm = self._grad_norm()
            # DeepSpeed steps the optimizer at the last micro-batch (the accumulation boundary)
            with tracing.span("learner.optimizer" if k == self.n_micro - 1 else "learner.accumulate"):
                self.engine.step()
            sums["loss"] += float(out.loss.detach())
            sums["clipped"] += out.clipped_sum
            sums["approx_kl"] += out.approx_kl_sum
            sums["kl"] += out.kl_sum
            sums["entropy"] += out.entropy_sum
        ds_norm = self.engine.get_global_grad_norm()
        if ds_norm is not None:
            grad_norm = float(ds_norm)
        return {
            "loss": sums["loss"],
            "grad_norm": grad_norm,
            "entropy": sums["entropy"] / total,
            "clip_frac": sums["clipped"] / total,
            "approx_kl": sums["approx_kl"] / total,
            "kl": sums["kl"] / total,
            "tokens": total,
        }

    def sft_step(self, batches: Sequence[Batch]) -> dict[str, float]:
        """One supervised optimizer step: mean negative log-likelihood of the loss-mask
        tokens (standard causal-LM cross-entropy, restricted to the trained tokens as in
        TRL's SFTTrainer completion-only / `assistant_only_loss`).

        Each micro-batch's summed NLL is divided by the whole step's loss-mask token
        count, so the accumulated gradient is that of the per-token mean over the step
        (as in train_step). `advantages` and `logprobs` of the batches are ignored.
        Returns loss (the step's mean NLL, nats/token, before the update), grad_norm
        (before clipping), tokens. A step without loss-mask tokens changes nothing.
        Raises ValueError unless there are exactly as many micro-batches as the engine
        accumulates.
        """
        if len(batches) != self.n_micro:
            raise ValueError(f"{len(batches)} micro-batches; the engine accumulates {self.n_micro}")
        total = float(sum(b.num_tokens for b in batches))
        if total == 0:
            return dict(loss=0.0, grad_norm=0.0, tokens=0.0)
        self.engine.train()
        loss_sum, grad_norm = 0.0, 0.0
        for k, mb in enumerate(batches):
            mb = Batch(*(t.to(self.device) for t in mb))
            logits = self.engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            logp, _ = token_logprobs(logits, mb.input_ids)
            del logits
            # select, never multiply: padding positions may hold anything
            loss = -torch.where(mb.loss_mask > 0, logp, 0.0).sum() / total
            self.engine.backward(loss, scale_wrt_gas=False)
            if k == self.n_micro - 1:
                grad_norm = self._grad_norm()
            self.engine.step()
            loss_sum += float(loss.detach())
        ds_norm = self.engine.get_global_grad_norm()
        if ds_norm is not None:
            grad_norm = float(ds_norm)
        return {"loss": loss_sum, "grad_norm": grad_norm, "tokens": total}

    def sft_eval(self, batches: Sequence[Batch]) -> dict[str, float]:
        """Mean negative log-likelihood (nats/token) of the loss-mask tokens of
        `batches` under the current policy, without updating anything. Any number of
        batches. Returns loss, tokens."""
        nll, total = 0.0, 0.0
        self.engine.eval()
        with torch.no_grad():
            for mb in batches:
                mb = Batch(*(t.to(self.device) for t in mb))
                logits = self.engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                logp, _ = token_logprobs(logits, mb.input_ids)
                del logits
                nll -= float(torch.where(mb.loss_mask > 0, logp, 0.0).sum())
                total += mb.num_tokens
        self.engine.train()
        return {"loss": nll / max(total, 1.0), "tokens": total}

    def _grad_norm(self) -> float:
        # ZeRO 1-3 report the norm themselves after the step; stage 0 leaves it in .grad
        sq = 0.0
        for p in self.module.parameters():
            if p.grad is not None:
                sq += float(p.grad.detach().float().pow(2).sum())
        return math.sqrt(sq)

    def weights_bytes(self) -> bytes:
        """The current weights as a safetensors file.

        LoRA: the peft adapter state dict (float32, peft's names, e.g.
        `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`).
        Full: every parameter under its Hugging Face name in bfloat16 (half the bytes;
        the sampler runs in bf16 or casts anyway); a tied lm_head is left out, as
        `save_pretrained` does.
        """
        from safetensors.torch import save

        with self._gathered():
            if self.kind == "lora":
                from peft import get_peft_model_state_dict

                sd = {k: v.detach().to("cpu", torch.float32).contiguous()
                      for k, v in get_peft_model_state_dict(self.module).items()}
            else:
                sd, seen = {}, set()
                for k, v in self.module.state_dict().items():
                    # tied weights share an address; ZeRO 1/2 flatten every parameter into
                    # one storage, so the storage alone would not tell them apart
                    key = (v.data_ptr(), tuple(v.shape))
                    if key in seen:
                        continue
                    seen.add(key)
                    sd[k] = v.detach().to("cpu", torch.bfloat16).contiguous()
        return save(sd)

    def save_state(self, directory: str | Path) -> None:
        """Write trainable weights and optimizer state (DeepSpeed's checkpoint format,
        any ZeRO stage; frozen base weights are left out) into `directory`."""
        self.engine.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False,
                                    exclude_frozen_parameters=True)
        # DeepSpeed keeps a frozen weight that is tied to another (lm_head to the
        # embedding) despite exclude_frozen_parameters: 113 MB for SmolLM2. Drop it.
        trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}
        for path in (Path(directory) / DS_TAG).glob("*model_states.pt"):
            state = torch.load(path, map_location="cpu", weights_only=False)
            module = state.get("module") or {}
            if any(k not in trainable for k in module):
                state["module"] = {k: v for k, v in module.items() if k in trainable}
                torch.save(state, path)

    def load_state(self, directory: str | Path) -> None:
        """Restore what `save_state` wrote. Raises if the files do not match the model."""
        path, _ = self.engine.load_checkpoint(str(directory), tag=DS_TAG, load_module_strict=False,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"no DeepSpeed checkpoint under {directory}")

    def save_pretrained(self, directory: str | Path) -> None:
        """Save for inference in Hugging Face format: the adapter (LoRA) or the whole
        model (full), plus the tokenizer."""
        with self._gathered():
            self.module.save_pretrained(str(directory), safe_serialization=True)
        self.tokenizer.save_pretrained(str(directory))

    def close(self) -> None:
        """Drop the engine's memory (the process serves the next job)."""
        self.engine.destroy()
        self.engine = None
        self.ref_model = None
        if self.device == "cuda":
            torch.cuda.empty_cache()

