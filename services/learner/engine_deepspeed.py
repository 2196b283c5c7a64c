"""The policy under training: a transformers causal LM (LoRA via peft, or every
parameter) wrapped in a DeepSpeed engine. The only module that imports deepspeed.

One rank, or one of `learner_ranks` data-parallel ranks (ranks.py, process_group.py;
gloo on CPU, nccl on CUDA); ZeRO stage from the job spec;
a client torch AdamW optimizer (DeepSpeed's CPU-Adam op would be compiled on first use,
about 80 s on a 2-core CPU machine). Gradients accumulate over a variable number of
micro-batches (the accumulation boundary is set by hand, DeepSpeed's
`set_gradient_accumulation_boundary`), and the optimizer steps once per update.
Logits are computed only over the span of positions that hold policy tokens
(`logits_to_keep`), and the softmax only at those positions.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from opentinker.schemas import JobSpec
from opentinker.services.core import tracing
from opentinker.services.learner import surrogates
from opentinker.services.learner.batching import Batch
from opentinker.services.learner.ds_config import deepspeed_config
from opentinker.services.learner.loss import (AggTotals, LossConfig, aggregation_weights, policy_loss,
                                              selected_logprobs)
from opentinker.services.learner.process_group import init_distributed

log = logging.getLogger("opentinker.learner.engine")

DS_TAG = "state"


def pick_device(device: str) -> str:
    """"auto" -> "cuda" when a GPU is visible, else "cpu"."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class TrainEngine:
    """A job's policy, optimizer and (when kl_coef > 0) reference policy.

    `model_path` is what `from_pretrained` accepts. Raises whatever transformers/peft
    raise for a bad model path or bad LoRA target modules (the job fails with it), and
    RuntimeError when DeepSpeed was first imported in this process for another device.
    """

    def __init__(self, spec: JobSpec, model_path: str, device: str = "auto"):
        device = pick_device(device)
        # DeepSpeed picks its accelerator once, at import; the settings' device decides it
        os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        picked = get_accelerator().device_name()
        if picked != os.environ["DS_ACCELERATOR"]:
            # an engine on the wrong accelerator would move the model to `picked` and
            # fail later, on its first batch, with a device-mismatch error
            os.environ["DS_ACCELERATOR"] = picked
            raise RuntimeError(f"a learner on {device!r} needs a process of its own: DeepSpeed's accelerator "
                               f"in this process is {picked!r}, fixed at its first import")
        from transformers import AutoTokenizer

        from opentinker.services.core.models import (load_policy_model, load_processor, lora_targets,
                                                     resolve_dtype, training_attention)

        self.spec = spec
        self.device = device
        self.kind = "lora" if spec.lora_rank > 0 else "full"
        self.loss_cfg = LossConfig.from_spec(spec)
        self.dtype = resolve_dtype(spec.dtype, device)
        dtype = torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        attention = training_attention(device, self.dtype)
        model = load_policy_model(model_path, dtype=dtype, **({"attn_implementation": attention} if attention else {}))
        # a vision-language model's image processor: Batch.images -> pixel values
        self.processor = load_processor(model_path)
        model.config.use_cache = False
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        # the model's context in tokens (0: the config does not say)
        self.max_len = int(getattr(getattr(model.config, "get_text_config", lambda: model.config)(),
                                   "max_position_embeddings", 0) or 0)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

        self.ref_model = None
        if self.kind == "lora":
            from peft import LoraConfig, get_peft_model

            targets = lora_targets(list(spec.lora_target_modules), vision=self.processor is not None)
            cfg = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                             target_modules=targets, bias="none", task_type="CAUSAL_LM")
            model = get_peft_model(model, cfg)
        elif spec.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False).to(device)

        self.rank, self.world_size = init_distributed(device)
        params = [p for p in model.parameters() if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in params)  # before ZeRO-3 partitions them
        # on CUDA, torch's fused AdamW: one kernel for every parameter's update instead of
        # the foreach path's several (torch.optim.AdamW docs, `fused`); the same update
        optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=device == "cuda")
        config = deepspeed_config(spec, self.world_size, self.dtype)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        log.info("engine ready: %s, %d trainable parameters, ZeRO %d, %s, %s, rank %d of %d",
                 self.kind, self.n_trainable, config["zero_optimization"]["stage"], self.dtype, device,
                 self.rank, self.world_size)

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

    def _logprobs(self, model, mb: Batch, temperature: float, entropy_grad: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target-aligned logp and entropy [B, T] (0 off the loss mask) of `mb` under
        `model` (the engine, a module, or the reference). Logits are made only over the
        span of columns holding a policy token (transformers' `logits_to_keep`), and the
        softmax only at the policy positions."""
        keep = mb.loss_mask > 0
        cols = keep.any(dim=0).nonzero().flatten()
        B, T = mb.input_ids.shape
        zeros = torch.zeros(B, T, dtype=torch.float32, device=mb.input_ids.device)
        if cols.numel() == 0:
            if self.world_size > 1:
                # a token-less pad (batching.shard_updates): a forward all the same (of
                # one column), its logits times 0, so that this rank's ZeRO-3 gathers and
                # backward all-reduces pair with the other ranks' (a zero gradient)
                logits = model(input_ids=mb.input_ids[:, :1], attention_mask=mb.attention_mask[:, :1],
                               logits_to_keep=1).logits
                zeros = zeros + 0.0 * logits.float().sum()
            return zeros, zeros
        lo, hi = int(cols[0]), int(cols[-1]) + 1
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, **self._vision(mb),
                       logits_to_keep=torch.arange(lo, hi, device=mb.input_ids.device)).logits
        sub = keep[:, lo:hi]
        targets = mb.input_ids[:, lo + 1:hi + 1]
        if targets.shape[1] < hi - lo:  # the last column predicts past the end (never kept)
            targets = torch.cat([targets, targets.new_zeros(B, hi - lo - targets.shape[1])], dim=1)
        logp_sel, ent_sel = selected_logprobs(logits[sub], targets[sub], temperature, entropy_grad=entropy_grad)
        del logits
        return zeros.masked_scatter(keep, logp_sel), zeros.masked_scatter(keep, ent_sel)

    def _vision(self, mb: Batch) -> dict[str, torch.Tensor]:
        """The forward's image inputs for `mb.images` (models.vision_inputs); {} for a
        text batch. Raises ValueError when a text model is given images."""
        from opentinker.services.core.models import vision_inputs

        return vision_inputs(self.processor, mb.images, self.device, next(self.module.parameters()).dtype)

    def _ref_logprobs(self, mb: Batch, temperature: float) -> torch.Tensor:
        with torch.no_grad():
            if self.kind == "lora":
                with self.module.disable_adapter():
                    return self._logprobs(self.module, mb, temperature)[0]
            return self._logprobs(self.ref_model, mb, temperature)[0]

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of the next optimizer update (the job's schedule)."""
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def sequence_logprobs(self, batches: Sequence[Batch], reference: bool) -> list[torch.Tensor]:
        """Without gradient: per micro-batch, the target-aligned [B, T] logprobs of its
        policy tokens under the reference policy (`reference`) or the current one."""
        temperature = self.spec.sampling.temperature or 1.0
        out = []
        self.engine.eval()
        with torch.no_grad():
            for mb in batches:
                mb = mb.to(self.device)
                out.append((self._ref_logprobs(mb, temperature) if reference
                            else self._logprobs(self.engine, mb, temperature)[0]).cpu())
        self.engine.train()
        return out

    def train_step(self, micro_batches: Sequence[Batch], updates: Sequence[Sequence[int]],
                   totals: Sequence[AggTotals], lrs: Sequence[float] | None = None) -> dict[str, float]:
        """The optimizer updates of one training step: a step.StepPlan (a rank's shard of
        it, data parallel: batching.shard_updates).

        micro_batches: the step's distinct micro-batches; updates: per optimizer update,
        its micro-batches as indices into `micro_batches` (each epoch repeats the same
        indices); totals: each update's AggTotals (its loss's normalizers,
        loss.aggregation_weights: micro-batch losses add up to the update's loss); lrs:
        each update's learning rate (the job's schedule; None keeps the optimizer's). The
        objective is loss.policy_loss with the job's LossConfig. When the behaviour
        correction is on (rollout_is), the proximal logprobs are the policy's before the
        step: the current ones, detached, with a single update; otherwise recomputed once
        per micro-batch before the first update (AReaL arXiv 2505.24298 §4, decoupled PPO).
        Returns loss (mean over updates), grad_norm (the last update's, before clipping),
        entropy, clip_frac, approx_kl, kl, is_weight_mean, is_capped_frac (token means over
        every pass), mismatch_kl (k3 of KL(sampler || learner before the step), a token
        mean; with rollout_is "none" over the first update's tokens, where the current
        policy is still the proximal one), tokens (policy tokens in one pass), updates,
        fwd_bwd_s, optimizer_s (seconds). No update, or none with a policy token: nothing
        changes and zeros are returned (an AdamW step on zero gradients would still move the
        weights, by momentum). Raises ValueError when totals (or lrs) do not match updates.
        """
        if len(totals) != len(updates) or (lrs is not None and len(lrs) != len(updates)):
            raise ValueError(f"{len(updates)} updates, {len(totals)} totals, {len(lrs or [])} lrs")
        cfg = self.loss_cfg
        temperature = self.spec.sampling.temperature or 1.0
        zero = dict(loss=0.0, grad_norm=0.0, entropy=0.0, clip_frac=0.0, approx_kl=0.0, kl=0.0,
                    is_weight_mean=0.0, is_capped_frac=0.0, mismatch_kl=0.0, tokens=0.0, updates=0.0,
                    fwd_bwd_s=0.0, optimizer_s=0.0)
        lrs = list(lrs) if lrs is not None else [None] * len(updates)
        if self.world_size > 1:
            # data parallel: every rank's shard holds as many micro-batches of each update,
            # so their backward passes pair up; an update is kept when any rank has a policy
            # token (on the device: nccl reduces CUDA tensors only)
            counts = torch.tensor([float(sum(micro_batches[i].num_tokens for i in u)) for u in updates],
                                  device=self.device)
            torch.distributed.all_reduce(counts)
            kept = [(u, tot, lr) for u, tot, lr, c in zip(updates, totals, lrs, counts.tolist()) if u and c > 0]
        else:
            updates = [[i for i in u if micro_batches[i].num_tokens > 0] for u in updates]
            kept = [(u, tot, lr) for u, tot, lr in zip(updates, totals, lrs) if u]
        if not kept:
            return zero
        prox: list[torch.Tensor | None] = [None] * len(micro_batches)  # recomputed proximal logprobs
        if cfg.rollout_is != "none" and len(kept) > 1:
            used = list(dict.fromkeys(i for u, _, _ in kept for i in u))
            for i, lp in zip(used, self.sequence_logprobs([micro_batches[i] for i in used], reference=False)):
                prox[i] = lp
        sums = dict(loss=0.0, clipped=0.0, approx_kl=0.0, kl=0.0, entropy=0.0, is_w=0.0, is_capped=0.0,
                    mismatch=0.0, mismatch_tokens=0.0, tokens=0.0)
        t_fb = t_opt = 0.0
        self.engine.train()
        grad_norm = 0.0
        for n_update, k, i, last, mb, tot in self.micro_steps(micro_batches, kept):
            t0 = self._clock()
            ref = self._ref_logprobs(mb, temperature) if cfg.kl_coef > 0 else None
            with tracing.span("learner.forward_backward", attrs={"ot.micro_batch": k,
                                                                 "ot.tokens": int(mb.input_ids.numel())}):
                logp, entropy = self._logprobs(self.engine, mb, temperature, entropy_grad=cfg.entropy_coef > 0)
                lp_prox = None
                if cfg.rollout_is != "none":
                    lp_prox = prox[i].to(self.device) if prox[i] is not None else logp.detach()
                out = policy_loss(logp, mb.logprobs, mb.advantages, mb.loss_mask, cfg,
                                  weights=aggregation_weights(mb.loss_mask, cfg.loss_agg, tot),
                                  logp_prox=lp_prox, logp_ref=ref, entropy=entropy)
                # DeepSpeed averages gradients over the ranks: times world_size, the
                # ranks' sum is the whole update's gradient, as on one rank
                self.engine.backward(out.loss * self.world_size, scale_wrt_gas=False)
            t1 = self._clock()
            t_fb += t1 - t0
            if last:
                grad_norm = self._grad_norm()
            # DeepSpeed steps the optimizer at the boundary (the update's last micro-batch)
            with tracing.span("learner.optimizer" if last else "learner.accumulate"):
                self.engine.step()
            t_opt += self._clock() - t1
            sums["loss"] += float(out.loss.detach())
            sums["clipped"] += out.clipped_sum
            sums["approx_kl"] += out.approx_kl_sum
            sums["kl"] += out.kl_sum
            sums["entropy"] += out.entropy_sum
            sums["is_w"] += out.is_weight_sum
            sums["is_capped"] += out.is_capped_sum
            if cfg.rollout_is != "none":
                sums["mismatch"] += out.mismatch_kl_sum
                sums["mismatch_tokens"] += out.tokens
            elif n_update == 0:
                # without the correction nothing computes the proximal logprobs, but
                # before the first optimizer step the current policy is the proximal
                # one, so its k3 against the sampler is the sampler/learner gap
                sums["mismatch"] += out.approx_kl_sum
                sums["mismatch_tokens"] += out.tokens
            sums["tokens"] += out.tokens
        ds_norm = self.engine.get_global_grad_norm()  # the last update's
        if ds_norm is not None:
            grad_norm = float(ds_norm)
        if self.world_size > 1:  # every rank's share of the sums
            keys = list(sums)
            t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(t)
            sums = dict(zip(keys, t.tolist()))
        n = max(sums["tokens"], 1.0)
        return {
            "loss": sums["loss"] / len(kept),
            "grad_norm": grad_norm,
            "entropy": sums["entropy"] / n,
            # an unclipped surrogate (dro, importance_sampling) clips nothing: no clip_frac
            **({"clip_frac": sums["clipped"] / n} if cfg.surrogate in surrogates.CLIPPED else {}),
            "approx_kl": sums["approx_kl"] / n,
            # KL to the reference only where the loss has that term: with kl_coef 0 (or
            # the KL in the reward) nothing computes it, and a 0 would read as one
            **({"kl": sums["kl"] / n} if cfg.kl_coef > 0 else {}),
            "is_weight_mean": sums["is_w"] / n if cfg.rollout_is != "none" else 1.0,
            "is_capped_frac": sums["is_capped"] / n,
            "mismatch_kl": sums["mismatch"] / max(sums["mismatch_tokens"], 1.0),
            "tokens": sums["tokens"] / max(1, self.spec.ppo_epochs),
            "updates": float(len(kept)),
            "fwd_bwd_s": t_fb,
            "optimizer_s": t_opt,
        }

    def micro_steps(self, micro_batches: Sequence[Batch],
                    kept: Sequence[tuple[Sequence[int], AggTotals, float | None]]):
        """Each update's micro-batches in order, as (update index, position in the update,
        index into `micro_batches`, whether it is the update's last, the batch on the
        device, the update's totals): the update's learning rate set (None: unchanged)
        before its first, DeepSpeed's gradient-accumulation boundary at its last.
        kept: per update, (micro-batch indices, totals, lr)."""
        for n, (u, tot, lr) in enumerate(kept):
            if lr is not None:
                self.set_lr(lr)
            for k, i in enumerate(u):
                last = k == len(u) - 1
                self.engine.set_gradient_accumulation_boundary(last)
                yield n, k, i, last, micro_batches[i].to(self.device), tot

    def sft_step(self, batches: Sequence[Batch]) -> dict[str, float]:
        """One supervised optimizer step: mean negative log-likelihood of the loss-mask
        tokens (standard causal-LM cross-entropy, restricted to the trained tokens as in
        TRL's SFTTrainer completion-only / `assistant_only_loss`).

        Each micro-batch's summed NLL is divided by the whole step's loss-mask token
        count, so the accumulated gradient is that of the per-token mean over the step
        (as in train_step). `advantages` and `logprobs` of the batches are ignored.
        Returns loss (the step's mean NLL, nats/token, before the update), grad_norm
        (before clipping), tokens. A step without loss-mask tokens changes nothing.
        """
        batches = [b for b in batches if b.num_tokens > 0]
        total = float(sum(b.num_tokens for b in batches))
        if total == 0:
            return dict(loss=0.0, grad_norm=0.0, tokens=0.0)
        self.engine.train()
        loss_sum, grad_norm = 0.0, 0.0
        for k, mb in enumerate(batches):
            last = k == len(batches) - 1
            mb = mb.to(self.device)
            self.engine.set_gradient_accumulation_boundary(last)
            logp, _ = self._logprobs(self.engine, mb, 1.0)
            # select, never multiply: padding positions may hold anything
            loss = -torch.where(mb.loss_mask > 0, logp, 0.0).sum() / total
            self.engine.backward(loss, scale_wrt_gas=False)
            if last:
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
                mb = mb.to(self.device)
                logp, _ = self._logprobs(self.engine, mb, 1.0)
                nll -= float(torch.where(mb.loss_mask > 0, logp, 0.0).sum())
                total += mb.num_tokens
        self.engine.train()
        return {"loss": nll / max(total, 1.0), "tokens": total}

    def tinker_pass(self, data: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor]]], loss_fn: str,
                    config: dict[str, float | str], backward: bool) -> tuple[list[torch.Tensor], dict[str, float]]:
        """A tinker session's forward (`backward` False) or forward_backward: per datum,
        the policy's logprob `lp` [N] of each target token, then its loss
        (tinker_losses.datum_loss, a sum over tokens); with `backward`, the loss's
        gradient is added to the accumulated one (no optimizer step: tinker_optim_step).

        data: per datum (tokens [N] int64, inputs by name, each [N]: `target_tokens`
        int64 and the loss's float32 arrays). Returns (lp per datum as float32 CPU
        tensors [N], metrics summed over the datums: "loss" and the loss's own).
        Raises tinker_losses.LossInputError for a bad loss or input.
        """
        from opentinker.services.learner.tinker_losses import datum_loss

        out: list[torch.Tensor] = []
        sums: dict[str, float] = {}
        self.engine.train(backward)
        with torch.set_grad_enabled(backward):
            for tokens, inputs in data:
                ids = tokens.to(self.device).unsqueeze(0)
                inputs = {k: v.to(self.device) for k, v in inputs.items()}
                logits = self.engine(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=0).logits[0]
                lp, _ = selected_logprobs(logits, inputs["target_tokens"].long(), 1.0)
                del logits
                loss, metrics = datum_loss(loss_fn, lp, inputs, config)
                if backward:
                    self.engine.set_gradient_accumulation_boundary(False)
                    self.engine.backward(loss, scale_wrt_gas=False)
                    self.engine.step()  # not at a boundary: DeepSpeed counts the micro-step only
                out.append(lp.detach().float().cpu())
                for k, v in metrics.items():  # "loss" among them
                    sums[k] = sums.get(k, 0.0) + v
        self.engine.train()
        return out, sums

    def tinker_optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step on the gradient accumulated since the last one (Tinker's
        optim_step: torch.optim.AdamW with these hyperparameters, decoupled weight
        decay; the gradient's global norm clipped to `grad_clip_norm` first when it is
        > 0), then the gradient is cleared. Returns grad_norm (before clipping)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = self._grad_norm()
        if grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)
        for group in self.engine.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        return {"grad_norm": norm}

    def _grad_norm(self) -> float:
        # ZeRO 1-3 report the norm themselves after the step; stage 0 leaves it in .grad.
        # One device sync for all of them (a float() per parameter was one each).
        norms = [torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32)
                 for p in self.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def _clock(self) -> float:
        """time.perf_counter() after the device's queued work is done: on CUDA the
        kernels run after the Python that launched them returns, so an unsynced timer
        charges a forward/backward to whatever synchronizes next (the optimizer's
        norm); fwd_bwd_s and optimizer_s are each their own part's time this way."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

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
        any ZeRO stage; frozen base weights are left out) into `directory`. Data
        parallel: every rank calls it with the same `directory` (one file system); each
        writes its ZeRO partition."""
        self.engine.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False,
                                    exclude_frozen_parameters=True)
        if self.world_size > 1:  # every rank's files are written; rank 0 alone edits them
            torch.distributed.barrier()
            if self.rank != 0:
                return
        # DeepSpeed keeps a frozen weight that is tied to another (lm_head to the
        # embedding) despite exclude_frozen_parameters: 113 MB for SmolLM2. Drop it.
        trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}
        for path in (Path(directory) / DS_TAG).glob("*model_states.pt"):
            state = torch.load(path, map_location="cpu", weights_only=False)
            module = state.get("module") or {}
            if any(k not in trainable for k in module):
                state["module"] = {k: v for k, v in module.items() if k in trainable}
                torch.save(state, path)

    def load_state(self, directory: str | Path, optimizer: bool = True) -> None:
        """Restore what `save_state` wrote (the optimizer state too unless `optimizer` is
        False), on any number of ranks: state saved by another
        number of ranks with per-rank optimizer partitions (ZeRO 1-3) is first
        converted to DeepSpeed's universal checkpoint (`ds_to_universal`, by rank 0 in
        `directory/universal`), which loads on any data-parallel degree (Lian et al.
        2024, "Universal Checkpointing", arXiv 2406.18820). Without ZeRO every rank
        loads the whole state. Raises if the files do not match the model."""
        directory = Path(directory)
        saved = self.saved_world_size(directory)
        # per-rank optimizer partitions (ZeRO 1-3; DeepSpeed's bf16 optimizer at stage 0)
        partitioned = any((directory / DS_TAG).glob("*optim_states.pt"))
        if optimizer and not partitioned and self.engine.zero_optimization():
            # a bfloat16 job's state from before such jobs ran at ZeRO 1 (deepspeed_config):
            # its optimizer state, kept without ZeRO, does not load into a ZeRO optimizer
            log.warning("%s holds no ZeRO optimizer state (saved at ZeRO 0): resuming its weights "
                        "with a fresh optimizer", directory)
            optimizer = False
        if partitioned and saved != self.world_size:
            universal = directory / "universal"
            if self.rank == 0:
                import argparse

                from deepspeed.checkpoint.ds_to_universal import main as to_universal

                log.info("checkpoint of %d ranks, resumed on %d: converting it to a universal checkpoint",
                         saved, self.world_size)
                to_universal(argparse.Namespace(
                    input_folder=str(directory / DS_TAG), output_folder=str(universal / DS_TAG),
                    num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                    inject_missing_state=True))
            if self.world_size > 1:
                torch.distributed.barrier()
            self.engine._config.load_universal_checkpoint = True  # the engine reads its config at load
            try:
                self._load(universal, optimizer)
            finally:
                self.engine._config.load_universal_checkpoint = False
            return
        self._load(directory, optimizer)

    def _load(self, directory: Path, optimizer: bool = True) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=DS_TAG, load_module_strict=False,
                                              load_optimizer_states=optimizer, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"no DeepSpeed checkpoint under {directory}")

    @staticmethod
    def saved_world_size(directory: str | Path) -> int:
        """The data-parallel ranks that wrote the DeepSpeed state under `directory`
        (what DeepSpeed records in its model-states file). Raises RuntimeError when
        there is none."""
        files = sorted((Path(directory) / DS_TAG).glob("*mp_rank_00_model_states.pt"))
        if not files:
            raise RuntimeError(f"no DeepSpeed checkpoint under {directory}")
        state = torch.load(files[0], map_location="cpu", weights_only=False)
        return int(state.get("dp_world_size") or 1)

    def save_pretrained(self, directory: str | Path) -> None:
        """Save for inference in Hugging Face format: the adapter (LoRA) or the whole
        model (full), plus the tokenizer."""
        with self._gathered():  # collective under ZeRO-3; rank 0 writes
            if self.rank == 0:
                self.module.save_pretrained(str(directory), safe_serialization=True)
        if self.rank == 0:
            self.tokenizer.save_pretrained(str(directory))

    def close(self) -> None:
        """Drop the engine's memory (the process serves the next job)."""
        self.engine.destroy()
        self.engine = None
        self.ref_model = None
        if self.device == "cuda":
            torch.cuda.empty_cache()

