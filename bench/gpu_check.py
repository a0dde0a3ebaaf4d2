"""The learner on a GPU, at a real model's shape (#15): one prepared check for wherever a GPU is at
hand (run by bench/gpu_check.sh, under 8 minutes on one GPU).

    python bench/gpu_check.py [--quick] [--shape qwen3-1.7b] [--segments 16] [--tokens 512]

1. A random-initialised model of Qwen3-1.7B's shape, built offline from its config (no download).
2. The molt-wb `Learner` on CUDA in bfloat16: its behavior log-probs come from the same weights
   one sequence at a time (as an engine would sample them), so `mismatch/kl` is the batch-shape
   numerics of bf16 alone; it prints step time, trained tokens/s and peak GPU memory.
3. FSDP2 on CUDA: the same model `fully_shard`ed per decoder layer in a one-rank NCCL process
   group, one forward, backward and AdamW step in bf16, its peak memory and time.
4. vLLM on CUDA (routed experts, its engine) is not checked yet: the script says whether it is
   installed.
"""

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from workbench.config import Config  # noqa: E402
from workbench.learner.learner import Learner  # noqa: E402
from workbench.segment import Segment  # noqa: E402

SHAPES = {
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}


def build(shape: str, folder: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[shape], dtype="bfloat16")
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def segments(model, count: int, tokens: int, vocab: int) -> list[Segment]:
    """Random prompts with a 'sampled' second half whose behavior log-probs the same weights
    give one sequence at a time."""
    from workbench.algo.losses import token_logprobs

    rng = np.random.default_rng(0)
    out = []
    for index in range(count):
        ids = rng.integers(0, vocab, size=tokens).astype(np.int32)
        mask = (np.arange(tokens) >= tokens // 2).astype(np.uint8)
        with torch.no_grad():
            row = torch.from_numpy(ids).long().cuda()[None]
            behavior = token_logprobs(model(input_ids=row).logits, row)[0].float().cpu().numpy()
        behavior = np.where(mask == 1, behavior, 0).astype(np.float32)
        version = np.where(mask == 1, 0, -1).astype(np.int32)
        reward = float(index % 2)
        out.append(Segment("gpu", index, 0, index // 4, ids, mask, behavior, version, reward))
    return out


def learner_check(path: str, args) -> None:
    cfg = OmegaConf.merge(
        OmegaConf.structured(Config),
        OmegaConf.from_dotlist(
            ["model.dtype=bfloat16", "ray.learner_gpus=1", "run.id=gpu", "trainer.lr=1e-6"]
        ),
    )
    torch.cuda.reset_peak_memory_stats()
    learner = Learner(cfg, path)
    batch = segments(learner.model, args.segments, args.tokens, learner.model.config.vocab_size)
    times = []
    first = None
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics, _ = learner.train(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        # the first step's: later ones sample nothing new, their batch grows stale
        first = first or metrics
    step = float(np.mean(times[1:] or times))
    print(
        f"learner (1 GPU, bf16): step {step:.3f} s, "
        f"{args.segments * args.tokens / step:,.0f} trained tokens/s, "
        f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, "
        f"first step: mismatch/kl {first['mismatch/kl']:.2e}, "
        f"gate/kept_frac {first['gate/kept_frac']:.3f}, loss {first['loss/policy']:.4f}"
    )
    del learner
    torch.cuda.empty_cache()


def fsdp_check(path: str, args) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.reset_peak_memory_stats()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (args.segments, args.tokens), device="cuda")
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = float(np.mean(times[1:] or times))
    print(
        f"FSDP2 (1 rank, NCCL, float32 master, bf16 compute): step {step:.3f} s, "
        f"{args.segments * args.tokens / step:,.0f} tokens/s, "
        f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="qwen3-0.6b, 4 x 128 tokens")
    args = parser.parse_args()
    if args.quick:
        args.shape = "qwen3-0.6b"
        args.segments = 4
        args.tokens = 128
    if not torch.cuda.is_available() and args.quick:
        print("gpu_check: no CUDA GPU on this machine, nothing checked (the smoke run ends here).")
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU; this machine has none.")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape}")
    with tempfile.TemporaryDirectory() as folder:
        path = build(args.shape, folder)
        learner_check(path, args)
        fsdp_check(path, args)
    installed = importlib.util.find_spec("vllm") is not None
    print(f"vLLM (installed: {installed}): routed experts and its engine are not checked here.")


if __name__ == "__main__":
    main()
