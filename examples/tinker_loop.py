"""Code written for Thinking Machines' Tinker API, run unchanged on OpenTinker.

    opentinker up &                                    # the stack, the Tinker API on :8471
    export TINKER_BASE_URL=http://127.0.0.1:8471
    export TINKER_API_KEY=tml-$(cat .opentinker/admin.key)   # tml- + an OpenTinker API key
    .venv/bin/python examples/tinker_loop.py

Two loops on SmolLM2-135M-Instruct with one LoRA training client: supervised
(cross-entropy on a few question/answer pairs: the loss before and after), then RL
(sample 16 answers to a yes-or-no question, reward 1 for "Yes", an importance-sampling
step: the reward before and after). Only the `tinker` package is used.
"""

import os

import numpy as np
import tinker

MODEL = os.environ.get("MODEL", "smollm2-135m-instruct")
PAIRS = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8"), ("What is 1 + 6?", "7"), ("What is 3 + 3?", "6")]


def chat(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def datum(prompt: list[int], completion: list[int], **per_token) -> tinker.Datum:
    """Tinker's alignment: input position i predicts token i + 1; the per-token inputs
    (weights, logprobs, advantages) cover the completion only."""
    full = prompt + completion
    pad = [0.0] * (len(prompt) - 1)
    inputs = {"target_tokens": np.array(full[1:], dtype=np.int64)}
    inputs.update({k: np.array(pad + list(v), dtype=np.float32) for k, v in per_token.items()})
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def main() -> None:
    with tinker.ServiceClient() as service:
        training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
        tok = training.get_tokenizer()

        answers = [tok.encode(a + tok.eos_token, add_special_tokens=False) for _, a in PAIRS]
        sft = [datum(chat(tok, q), a, weights=[1.0] * len(a)) for (q, _), a in zip(PAIRS, answers)]
        n_tokens = sum(len(a) for a in answers)
        losses = []
        for _ in range(10):
            fb = training.forward_backward(sft, "cross_entropy")
            training.optim_step(tinker.AdamParams(learning_rate=1e-3))
            losses.append(fb.result().metrics["loss:sum"] / n_tokens)
        print(f"SFT loss per token: {losses[0]:.3f} -> {losses[-1]:.3f}")

        prompt = chat(tok, "Answer yes or no: is water wet?")
        rewards = []
        for _ in range(10):
            sampler = training.save_weights_and_get_sampling_client().result()
            res = sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=16,
                                 sampling_params=tinker.SamplingParams(max_tokens=4, temperature=1.0)).result()
            r = np.array([float(tok.decode(s.tokens).strip().lower().startswith("yes")) for s in res.sequences])
            rewards.append(r.mean())
            if r.std() > 0:
                training.forward_backward([datum(prompt, list(s.tokens), logprobs=s.logprobs,
                                                 advantages=[a] * len(s.tokens))
                                           for s, a in zip(res.sequences, r - r.mean())], "importance_sampling")
            training.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        print(f"RL reward: {rewards[0]:.3f} -> {rewards[-1]:.3f} (by iteration: "
              f"{', '.join(f'{x:.2f}' for x in rewards)})")


if __name__ == "__main__":
    main()
