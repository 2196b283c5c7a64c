"""Two training steps of the learner's engine on one fixed batch, as one rank of a
data-parallel group started by torchrun (`python -m torch.distributed.run
--nproc_per_node N engine_step.py MODEL OUT ZERO_STAGE [DEVICE [save|resume CHECKPOINT]]`):
each rank trains on its shard (batching.shard_updates); rank 0 writes the metrics and
the weights to OUT. "save": both steps, the engine's state written to CHECKPOINT between them (a save
changes nothing the second step computes); "resume": that state loaded (written by any
number of ranks), then the second step alone. tests/integration/test_learner_ranks.py
compares 1 rank with 2."""

import json
import sys
from pathlib import Path

import torch

from opentinker.schemas import JobSpec, Trajectory, TurnRecord
from opentinker.services.learner.batching import micro_batches, shard_updates
from opentinker.services.learner.engine_deepspeed import TrainEngine
from opentinker.services.learner.loss import AggTotals


def trajectory(i: int, prompt: int, gen: int, reward: float) -> Trajectory:
    ids = [(7 * i + 3 * k) % 500 + 10 for k in range(prompt + gen)]
    return Trajectory(job_id="j", request_id="r", episode_id=f"e{i}", step=0, group_index=0, group_size=8,
                      token_ids=ids, loss_mask=[0] * prompt + [1] * gen,
                      logprobs=[0.0] * prompt + [-2.0 - 0.1 * i] * gen, prompt_len=prompt,
                      turns=[TurnRecord(gen_start=prompt, gen_end=prompt + gen, obs_end=prompt + gen)],
                      reward=reward, policy_version=0)


def main(model: str, out: Path, zero_stage: int, device: str = "cpu", mode: str = "", checkpoint: str = "") -> None:
    torch.manual_seed(0)  # the same LoRA init on every rank and in every run
    spec = JobSpec(lora_rank=4, lora_alpha=8, lr=1e-2, micro_batch_size=2, prompts_per_step=1, group_size=8,
                   zero_stage=zero_stage)
    eng = TrainEngine(spec, model, device=device)
    # 9 episodes in 5 micro-batches: with 2 ranks, rank 1 holds a token-less pad
    trajs = [trajectory(i, 4 + i % 3, 3 + i % 4, float(i % 2)) for i in range(9)]
    adv = [1.0 if t.reward else -1.0 for t in trajs]
    mbs = micro_batches(trajs, adv, spec.micro_batch_size, eng.pad_id)
    # sampled by this very policy: ratio and importance weight start at 1 (full gradients)
    mbs = [b._replace(logprobs=lp.detach()) for b, lp in zip(mbs, eng.sequence_logprobs(mbs, reference=False))]
    tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=float(len(trajs)), max_len=32.0)
    mine, updates = shard_updates(mbs, [list(range(len(mbs)))], eng.rank, eng.world_size)
    if mode == "resume":
        eng.load_state(checkpoint)
    # the second step uses Adam's state
    steps = []
    for step in range(1 if mode == "resume" else 2):
        steps.append(eng.train_step(mine, updates, [tot], [spec.lr]))
        if mode == "save" and step == 0:
            eng.save_state(checkpoint)
    weights = eng.weights_bytes()
    if eng.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps({"steps": steps, "world_size": eng.world_size,
                                                      "micro_batches": [len(u) for u in updates]}))
        (out / "weights.safetensors").write_bytes(weights)
    eng.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
