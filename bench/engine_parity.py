"""Engine parity: the torch engine and the vLLM engine on the same tiny model and prompts.

    python bench/engine_parity.py [--model tiny|tiny-moe] [--prompts 32] [--tokens 64] [--temperature 1.0]

(needs `pip install 'molt-wb[vllm]'`.) Each engine generates `--tokens` new tokens (no stop ids) for
the same `--prompts` random prompts, after one warm-up call; throughput is sampled tokens over the
wall time of that call. Parity: the ids vLLM sampled are scored by the torch engine's model (one
plain forward, log softmax(logits / T)), and the two log-probs of every sampled token are compared:
mismatch KL (k3 estimator, mean over tokens of r - 1 - log r, r = p_torch / p_vllm, as the learner
logs `mismatch/kl`) and the largest |Δ log-prob|.
"""

import argparse
import time

import numpy as np
import torch

from workbench.engines.base import SamplingParams


def timed(engine, prompts, params):
    engine.generate(prompts[:2], params)  # warm-up (vLLM compiles on its first request)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return out, sum(len(g.token_ids) for g in out) / seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    from workbench.engines.torch_engine import TorchEngine
    from workbench.engines.vllm_engine import VllmEngine
    from workbench.models.tiny import tiny_model_path

    path = str(tiny_model_path(args.model))
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(5, 400, size=rng.integers(8, 33)).astype(np.int32) for _ in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0)
    torch_engine, vllm_engine = TorchEngine(path), VllmEngine(path)
    _, torch_speed = timed(torch_engine, prompts, params)
    sampled, vllm_speed = timed(vllm_engine, prompts, params)

    deltas = []  # log p_torch - log p_vllm per sampled token
    if torch_engine.moe:
        torch_engine.model.set_experts_implementation("eager")
    for prompt, generation in zip(prompts, sampled):
        ids = torch.tensor(np.concatenate([prompt, generation.token_ids]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = (
                torch_engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                / args.temperature
            )
        scored = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(generation.token_ids, dtype=torch.long)[:, None]
        )
        deltas.append(scored.squeeze(-1).numpy() - generation.logprobs)
    delta = np.concatenate(deltas).astype(np.float64)
    kl = float(np.mean(np.exp(delta) - 1 - delta))
    print(
        f"model {args.model}, {args.prompts} prompts x {args.tokens} tokens, temperature {args.temperature}, float32"
    )
    print(f"torch engine: {torch_speed:8.0f} tokens/s")
    print(f"vLLM engine:  {vllm_speed:8.0f} tokens/s")
    print(
        f"mismatch KL (k3) on vLLM's {delta.size} sampled ids: {kl:.2e}; max |Δ log-prob| {np.abs(delta).max():.2e}"
    )


if __name__ == "__main__":  # vLLM spawns processes: nothing may start at import
    main()
