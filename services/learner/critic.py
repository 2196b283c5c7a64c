"""PPO's learned critic (advantage_estimator "gae"): a value model beside the policy,
and the two behind the policy engine's interface.

The critic is the job's model with a scalar head in place of the LM head
(transformers' AutoModelForTokenClassification with one label, as verl's critic and
OpenRLHF's value model), LoRA on the same modules as the policy (the head trained in
full) or every parameter, in its own DeepSpeed engine with its own AdamW at
`critic_lr`. It is initialized from the policy's weights, its head at 0 (every value
0 before the first update). Its value of a state is its output at the state's last token, so its
[B, T] outputs are target-aligned like the policy's logprobs (column t: the value
before token t + 1). It trains on the step's updates (PPO's epochs and
mini-batches, the same micro-batches as the policy) with the clipped value loss
(gae.value_loss), token-mean over each update's policy tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from opentinker.schemas import JobSpec
from opentinker.services.learner.batching import Batch
from opentinker.services.learner.ds_config import deepspeed_config
from opentinker.services.learner.engine_deepspeed import DS_TAG, TrainEngine, pick_device
from opentinker.services.learner.gae import explained_variance, value_loss
from opentinker.services.learner.loss import AggTotals, aggregation_weights

log = logging.getLogger("opentinker.learner.critic")

CRITIC_DIR = "critic"  # the critic's DeepSpeed state, under the policy's checkpoint folder


class CriticEngine(TrainEngine):
    """A job's value model (module docstring). Shares TrainEngine's state handling
    (save_state, load_state, set_lr, close); its own __init__, `values` and `train_step`.

    Raises ValueError for a vision-language model (no token-classification class; the
    job fails naming advantage_estimator), and what transformers/peft raise for a bad
    model or LoRA targets.
    """

    def __init__(self, spec: JobSpec, model_path: str, device: str = "auto"):
        device = pick_device(device)
        os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
        import deepspeed
        from transformers import AutoConfig, AutoModelForTokenClassification

        from opentinker.services.core.models import (is_vision_language, lora_targets, resolve_dtype,
                                                     training_attention)
        from opentinker.services.learner.process_group import init_distributed

        if is_vision_language(model_path):
            raise ValueError(f"advantage_estimator: 'gae' needs a value head on a text model; {spec.model!r} is a "
                             "vision-language model")
        self.spec, self.device = spec, device
        self.kind = "lora" if spec.lora_rank > 0 else "full"
        self.dtype = resolve_dtype(spec.dtype, device)
        attention = training_attention(device, self.dtype)
        # classifier_dropout 0: dropout on a regression head only adds noise to the targets (verl sets 0 too)
        config = AutoConfig.from_pretrained(model_path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(
            model_path, config=config, dtype=torch.bfloat16 if self.dtype == "bfloat16" else torch.float32,
            **({"attn_implementation": attention} if attention else {}))
        model.config.use_cache = False
        # the head starts at 0: every value 0, so the first step's advantages are the
        # whitened returns, not the returns less a random head's output (on SmolLM2-135M
        # the default init gave values of +-0.6 on 0/1 rewards and a negative explained
        # variance for the first dozen steps)
        head = getattr(model, "score", None) or getattr(model, "classifier", None)
        if not isinstance(head, torch.nn.Linear):
            raise ValueError(f"advantage_estimator: 'gae' found no linear value head on {spec.model!r}")
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
        if self.kind == "lora":
            from peft import LoraConfig, get_peft_model

            # TOKEN_CLS: peft trains the head ("score"/"classifier") in full beside the adapters
            model = get_peft_model(model, LoraConfig(
                r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=0.0, bias="none", task_type="TOKEN_CLS",
                target_modules=lora_targets(list(spec.lora_target_modules), vision=False)))
        self.ref_model = None
        self.rank, self.world_size = init_distributed(device)
        params = [p for p in model.parameters() if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in params)
        optimizer = torch.optim.AdamW(params, lr=spec.critic_lr or spec.lr, weight_decay=spec.weight_decay,
                                      fused=device == "cuda")
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=deepspeed_config(spec, self.world_size, self.dtype))
        log.info("critic ready: %s, %d trainable parameters, %s, %s", self.kind, self.n_trainable, self.dtype, device)

    def _values(self, mb: Batch) -> torch.Tensor:
        """[B, T] float32 values of `mb` (target-aligned), 0 off the loss mask."""
        out = self.engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[..., 0].float()
        return torch.where(mb.loss_mask > 0, out, 0.0)

    def values(self, batches: Sequence[Batch]) -> list[torch.Tensor]:
        """Without gradient: per micro-batch, the critic's [B, T] values (CPU, float32,
        target-aligned, 0 off the loss mask)."""
        self.engine.eval()
        with torch.no_grad():
            out = [self._values(mb.to(self.device)).cpu() for mb in batches]
        self.engine.train()
        return out

    def train_step(self, micro_batches: Sequence[Batch], updates: Sequence[Sequence[int]],
                   totals: Sequence[AggTotals], lrs: Sequence[float] | None = None) -> dict[str, float]:
        """The critic's updates of one step: for each update (indices into
        `micro_batches`, which carry `values` and `returns`), the clipped value loss
        (gae.value_loss, eps spec.value_clip), token-mean over the update's policy
        tokens (`totals`), one optimizer step at `lrs[n]` (None: unchanged).

        Returns value_loss (mean over updates), value_error (0.5 (V - R)^2 per token),
        value_clip_frac, value_mean (predictions per token, over every pass), return_mean
        and value_explained_var (of the values the advantages were computed from against
        the returns, over the step's distinct micro-batches; gae.explained_variance),
        critic_grad_norm (the last update's). No update with a policy token: {}.
        Raises ValueError when a micro-batch has no values or returns, or totals or lrs
        do not match updates.
        """
        if len(totals) != len(updates) or (lrs is not None and len(lrs) != len(updates)):
            raise ValueError(f"{len(updates)} updates, {len(totals)} totals, {len(lrs or [])} lrs")
        if any(mb.values is None or mb.returns is None for mb in micro_batches):
            raise ValueError("the critic's micro-batches need values and returns (step.plan_step with a critic)")
        lrs = list(lrs) if lrs is not None else [None] * len(updates)
        kept = [([i for i in u if micro_batches[i].num_tokens > 0], tot, lr)
                for u, tot, lr in zip(updates, totals, lrs)]
        kept = [k for k in kept if k[0]]
        if not kept:
            return {}
        used = sorted({i for u, _, _ in kept for i in u})
        mask = torch.cat([micro_batches[i].loss_mask.flatten() for i in used])
        ev = explained_variance(torch.cat([micro_batches[i].values.flatten() for i in used]),
                                torch.cat([micro_batches[i].returns.flatten() for i in used]), mask)
        sums = dict(loss=0.0, error=0.0, clipped=0.0, value=0.0, ret=0.0, tokens=0.0)
        grad_norm = 0.0
        self.engine.train()
        for _, _, _, last, mb, tot in self.micro_steps(micro_batches, kept):
            out = value_loss(self._values(mb), mb.values, mb.returns, mb.loss_mask, self.spec.value_clip,
                             aggregation_weights(mb.loss_mask, "token-mean", tot))
            self.engine.backward(out.loss, scale_wrt_gas=False)
            if last:
                grad_norm = self._grad_norm()
            self.engine.step()  # DeepSpeed steps the optimizer at the update's last micro-batch
            sums["loss"] += float(out.loss.detach())
            sums["error"] += out.error_sum
            sums["clipped"] += out.clipped_sum
            sums["value"] += out.value_sum
            sums["ret"] += float(torch.where(mb.loss_mask > 0, mb.returns, 0.0).sum())
            sums["tokens"] += out.tokens
        ds_norm = self.engine.get_global_grad_norm()
        if ds_norm is not None:
            grad_norm = float(ds_norm)
        n = max(sums["tokens"], 1.0)
        return {"value_loss": sums["loss"] / len(kept), "value_error": sums["error"] / n,
                "value_clip_frac": sums["clipped"] / n, "value_mean": sums["value"] / n, "return_mean": sums["ret"] / n,
                **({"value_explained_var": ev} if ev == ev else {}), "critic_grad_norm": grad_norm}


class ActorCritic:
    """A policy engine and its critic behind the policy's interface (what job.py and
    lifecycle.py call): `values` is the critic's, `train_step` trains both on the
    step's plan (the critic at the policy's schedule times critic_lr / lr), the state
    holds both (the critic under CRITIC_DIR), every other attribute is the policy's."""

    def __init__(self, policy: TrainEngine, critic: CriticEngine):
        self.policy = policy
        self.critic = critic

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    def values(self, batches: Sequence[Batch]) -> list[torch.Tensor]:
        """The critic's values (CriticEngine.values)."""
        return self.critic.values(batches)

    def train_step(self, micro_batches: Sequence[Batch], updates: Sequence[Sequence[int]],
                   totals: Sequence[AggTotals], lrs: Sequence[float] | None = None) -> dict[str, float]:
        """The critic's updates, then the policy's (both on the values from before the
        step, as verl's update_critic before update_actor); their metrics merged."""
        critic = self._train_critic(micro_batches, updates, totals, lrs)
        return {**self.policy.train_step(micro_batches, updates, totals, lrs), **critic}

    def train_critic(self, micro_batches: Sequence[Batch], updates: Sequence[Sequence[int]],
                     totals: Sequence[AggTotals], lrs: Sequence[float] | None = None) -> dict[str, float]:
        """A step of the critic's warmup (JobSpec.critic_warmup): the critic's updates
        alone, the policy unchanged; its metrics with the policy's zeros (no update, no
        token: TrainEngine.train_step of nothing)."""
        critic = self._train_critic(micro_batches, updates, totals, lrs)
        return {**self.policy.train_step(micro_batches, [], [], []), **critic}

    def _train_critic(self, micro_batches, updates, totals, lrs) -> dict[str, float]:
        """CriticEngine.train_step at the policy's schedule times critic_lr / lr."""
        spec = self.policy.spec
        scale = (spec.critic_lr or spec.lr) / spec.lr
        return self.critic.train_step(micro_batches, updates, totals,
                                      None if lrs is None else [lr * scale for lr in lrs])

    def save_state(self, directory: str | Path) -> None:
        """The policy's state in `directory`, the critic's in `directory/critic`."""
        self.policy.save_state(directory)
        self.critic.save_state(Path(directory) / CRITIC_DIR)

    def load_state(self, directory: str | Path, optimizer: bool = True) -> None:
        """Restore both. A resume (`optimizer`) needs the critic's state; a start from
        another job's policy (init_from, without its optimizer) whose checkpoint has no
        critic keeps this critic fresh. Raises RuntimeError for a resume without it."""
        self.policy.load_state(directory, optimizer)
        critic = Path(directory) / CRITIC_DIR
        if (critic / DS_TAG).is_dir():
            self.critic.load_state(critic, optimizer)
        elif optimizer:
            raise RuntimeError(f"no critic state under {directory}: the checkpoint is of a job without a critic")
        else:
            log.info("the checkpoint under %s has no critic: the critic starts from the model", directory)

    def close(self) -> None:
        """Drop both engines' memory."""
        self.critic.close()
        self.policy.close()
