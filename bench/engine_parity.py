"""Engine parity: the torch engine and the vLLM engine on the same tiny model and prompts.

    python bench/engine_parity.py [--quick] [--model tiny|tiny-moe] [--prompts 32] [--tokens 64]
        [--temperature 1.0]

(needs `pip install 'molt-wb[vllm]'`; with `--quick` and no vLLM, the torch engine runs alone and
a line says vLLM is absent.) Each engine generates `--tokens` new tokens (no stop ids) for
the same `--prompts` random prompts, after one warm-up call; throughput is sampled tokens over the
wall time of that call. Parity: the ids vLLM sampled are scored by the torch engine's model (one
plain forward, log softmax(logits / T)), and the two log-probs of every sampled token are compared:
mismatch KL (k3 estimator, mean over tokens of r - 1 - log r, r = p_torch / p_vllm, as the learner
logs `mismatch/kl`) and the largest |Δ log-prob|.
"""

import argparse
import importlib.util
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


def log_prob_deltas(torch_engine, prompts, sampled, temperature: float) -> np.ndarray:
    """log p_torch - log p_vllm of every token vLLM sampled, all prompts' tokens in one array."""
    if torch_engine.moe:
        torch_engine.model.set_experts_implementation("eager")
    deltas = []
    for prompt, generation in zip(prompts, sampled, strict=True):
        ids = torch.tensor(np.concatenate([prompt, generation.token_ids]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = torch_engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits.float() / temperature, -1)
        sampled_ids = torch.tensor(generation.token_ids, dtype=torch.long)[:, None]
        scored = logprobs.gather(-1, sampled_ids).squeeze(-1)
        deltas.append(scored.numpy() - generation.logprobs)
    return np.concatenate(deltas).astype(np.float64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4 prompts x 8 tokens: a smoke run")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    if args.quick:
        args.prompts = 4
        args.tokens = 8
    has_vllm = importlib.util.find_spec("vllm") is not None
    if not has_vllm and not args.quick:
        raise SystemExit("engine_parity needs vLLM: pip install -e '.[vllm]' (or pass --quick).")

    from workbench.engines.torch_engine import TorchEngine
    from workbench.models.tiny import tiny_model_path

    path = str(tiny_model_path(args.model))
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(5, 400, size=rng.integers(8, 33)).astype(np.int32) for _ in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0)
    torch_engine = TorchEngine(path)
    _, torch_speed = timed(torch_engine, prompts, params)
    print(
        f"model {args.model}, {args.prompts} prompts x {args.tokens} tokens, "
        f"temperature {args.temperature}, float32"
    )
    print(f"torch engine: {torch_speed:8.0f} tokens/s")
    if not has_vllm:
        print("vLLM engine:  absent (vllm is not installed): parity not measured")
        return

    from workbench.engines.vllm_engine import VllmEngine

    sampled, vllm_speed = timed(VllmEngine(path), prompts, params)
    delta = log_prob_deltas(torch_engine, prompts, sampled, args.temperature)
    kl = float(np.mean(np.exp(delta) - 1 - delta))
    print(f"vLLM engine:  {vllm_speed:8.0f} tokens/s")
    print(
        f"mismatch KL (k3) on vLLM's {delta.size} sampled ids: {kl:.2e}; "
        f"max |Δ log-prob| {np.abs(delta).max():.2e}"
    )


if __name__ == "__main__":  # vLLM spawns processes: nothing may start at import
    main()
