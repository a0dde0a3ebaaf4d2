"""How far from this machine's compute limit the learner and the engine run on SmolLM2-135M.

    python bench/roofline.py [--quick] [--threads 1,2] [--dtypes float32,bfloat16] [--memory]

1. The limit: the best rate of matrix products (2·m·k·n FLOP each: square ones of 512, 1024 and
   2048, and the model's own MLP projection of 512 tokens, 512 x 576 by 576 x 1536) in float32
   and bfloat16, with one thread and with every core.
2. The learner: molt-wb's learner forward (models/heads.py: log-probs and entropy in chunks of
   tokens), backward and AdamW step on 4 rows x 128 distinct tokens (no shared prompt), in model
   FLOP = 6 · parameters · tokens (SmolLM2's input embedding is its output layer: every parameter
   is used once per token).
3. The engine: molt-wb's torch engine generating 32 new tokens for 8 prompts of 64 tokens: the
   prefill (2 · body parameters · prompt tokens: the output layer runs at each prompt's last
   position only) and the decode (2 · parameters · new tokens).
4. The learner step's memory (16 rows x 128 tokens): the resident peak it adds over the model and
   its gradients (Linux's high-water mark, reset before the step, in a fresh process each) with
   the output layer in chunks of tokens and with the whole batch's logits kept (`--memory`: this
   part alone).

Every rate is given per wall second and per CPU second of this process (all its threads): on a
machine shared with other jobs the wall rate moves with their load and the CPU rate much less, so
the model FLOP utilisation (MFU) is the model's rate per CPU second over the matrix products' rate
per CPU second, same dtype and threads. Attention's own FLOP (quadratic in the sequence) are left
out of the model FLOP, as is custom: at these lengths they are under 5 % of the total. The model is
the converted SmolLM2-135M-Instruct (model=smollm2-135m: the hub, or the registry's GGUF converted
once); `--quick` runs a random model of its shape with 4 of its 30 layers (no download), smaller
batches and one step: a smoke run, figures printed, not asserted.
"""

import argparse
import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workbench.algo.losses import token_logprobs_entropy  # noqa: E402
from workbench.engines.base import SamplingParams  # noqa: E402
from workbench.engines.torch_engine import TorchEngine  # noqa: E402
from workbench.models.heads import forward_logprobs_entropy  # noqa: E402
from workbench.models.multimodal import load_policy  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the learner step whose memory part 4 measures (rows, tokens), by --quick: 2,048 tokens hold 400 MB
# of float32 logits over SmolLM2's vocabulary
MEMORY_BATCH = {False: (16, 128), True: (2, 32)}
# SmolLM2-135M's shape (its config.json)
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


class Seconds:
    """Wall seconds and this process's CPU seconds (every thread's) of the blocks it times."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        wall = time.perf_counter()
        cpu = time.process_time()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - wall
            self.cpu += time.process_time() - cpu

    def rates(self, flop: float) -> tuple[float, float]:
        """`flop` per wall second and per CPU second."""
        return flop / max(self.wall, 1e-9), flop / max(self.cpu, 1e-9)


def matmul_flops(
    shape: tuple[int, int, int], dtype: torch.dtype, seconds: float
) -> tuple[float, float]:
    """The best FLOP per wall second and per CPU second of [m, k] x [k, n] matrix products in
    `dtype`, over about `seconds`."""
    m, k, n = shape
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    torch.mm(a, b)  # warm-up: the kernel's first call
    best = (0.0, 0.0)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        clock = Seconds()
        products = 0
        # samples of 50 ms at least: other threads' CPU time is counted at the scheduler's ticks
        with clock.timed():
            begin = time.perf_counter()
            while products == 0 or time.perf_counter() - begin < 0.05:
                torch.mm(a, b)
                products += 1
        rates = clock.rates(2 * m * k * n * products)
        best = (max(best[0], rates[0]), max(best[1], rates[1]))
    return best


def model_folder(quick: bool, scratch: str) -> str:
    """The SmolLM2-135M checkpoint folder; with `quick`, a random 4-layer model of its shape."""
    if not quick:
        from workbench.models.pretrained import named_path

        return str(named_path("smollm2-135m"))
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**dict(SMOLLM2, num_hidden_layers=4), pad_token_id=2, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(scratch)
    return scratch


def flop_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(the body's parameters, the output layer's) of a causal LM: a token's forward costs 2 FLOP
    per body parameter, and 2 per output-layer parameter where its logits are computed; the input
    embedding is a lookup (none when it is the output layer, tied)."""
    head = model.get_output_embeddings().weight
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    body = total - head.numel()
    if embedding is not head:
        body -= embedding.numel()
    return body, head.numel()


def learner_flops(
    path: str, dtype: torch.dtype, rows: int, tokens: int, steps: int
) -> tuple[float, float]:
    """Model FLOP (6 · (body + output layer) · tokens) per wall second and per CPU second of the
    learner's forward (log-probs and entropy in chunks), backward and AdamW step on `rows` x
    `tokens` distinct ids."""
    model = load_policy(path, str(dtype).removeprefix("torch.")).train()
    parameters = sum(flop_counts(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (rows, tokens), generator=generator)
    mask = torch.ones_like(ids)
    inputs = dict(input_ids=ids, attention_mask=mask)
    clock = Seconds()
    for step in range(steps + 1):
        # the first step warms up (and allocates AdamW's state): not counted
        with clock.timed() if step else contextlib.nullcontext():
            logprob, entropy = forward_logprobs_entropy(model, inputs, ids, 1.0, True)
            loss = -(logprob * mask).mean() - 1e-3 * (entropy * mask).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return clock.rates(6 * parameters * rows * tokens * steps)


def learner_peak_mb(path: str, rows: int, tokens: int, chunked: bool) -> float | None:
    """The resident memory (MB) a learner step (forward with log-probs and entropy, backward)
    adds at its peak over the loaded model and its gradients, with the output layer in chunks of
    tokens or the batch's whole logits, in a fresh process (memory an earlier step freed stays
    with the allocator); None where Linux's /proc is absent."""
    if not Path("/proc/self/status").exists():
        return None
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_step_peak_mb, (path, rows, tokens, chunked))


def _step_peak_mb(path: str, rows: int, tokens: int, chunked: bool) -> float:
    """`learner_peak_mb` in this (fresh) process."""
    torch.set_num_threads(1)
    model = load_policy(path).train()
    for parameter in model.parameters():
        # written, not only allocated: untouched pages are not resident yet
        parameter.grad = torch.ones_like(parameter).zero_()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (rows, tokens), generator=generator)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    status = Path("/proc/self/status")

    def kib(key: str) -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith(key))
        return int(line.split()[1])

    Path("/proc/self/clear_refs").write_text("5")
    before = kib("VmRSS")
    if chunked:
        logprob, entropy = forward_logprobs_entropy(model, inputs, ids, 1.0, True)
    else:
        logits = model(**inputs).logits
        logprob, entropy = token_logprobs_entropy(logits, ids, 1.0, True)
    (-(logprob.mean()) - 1e-3 * entropy.mean()).backward()
    return (kib("VmHWM") - before) / 1e3


def engine_flops(
    path: str, dtype: torch.dtype, prompts: int, prompt_tokens: int, new_tokens: int
) -> dict[str, tuple[float, float]]:
    """The engine's prefill model FLOP (2 · body · prompt tokens, and the output layer at each
    prompt's last position only) and decode model FLOP (2 · (body + output layer) · new tokens) per
    wall second and per CPU second, and its new tokens per second (wall and CPU), on `prompts`
    distinct random prompts."""
    engine = TorchEngine(path, str(dtype).removeprefix("torch."))
    body, head = flop_counts(engine.model)
    generator = torch.Generator().manual_seed(1)
    vocab = engine.model.config.vocab_size
    batch = [
        torch.randint(10, vocab, (prompt_tokens,), generator=generator).numpy()
        for _ in range(prompts)
    ]
    engine.generate(batch[:1], SamplingParams(max_tokens=2, seed=0))  # warm-up
    prefill = Seconds()
    with prefill.timed():
        engine.generate(batch, SamplingParams(max_tokens=1, seed=0))
    total = Seconds()
    with total.timed():
        generations = engine.generate(batch, SamplingParams(max_tokens=new_tokens, seed=0))
    new = sum(len(g.token_ids) for g in generations)
    # the whole call less its prefill (and first token): new - 1 decode steps per row
    decode = Seconds()
    decode.wall = total.wall - prefill.wall
    decode.cpu = total.cpu - prefill.cpu
    return {
        "prefill": prefill.rates(2 * body * prompts * prompt_tokens + 2 * head * prompts),
        "decode": decode.rates(2 * (body + head) * (new - len(generations))),
        "new tokens": total.rates(new),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a random 4-layer model, one step")
    parser.add_argument(
        "--threads", default=f"1,{os.cpu_count()}", help="torch thread counts to measure"
    )
    parser.add_argument(
        "--dtypes",
        default="",
        help="dtypes the model runs in (default: float32, and bfloat16 where its matrix products "
        "beat float32's)",
    )
    parser.add_argument(
        "--memory", action="store_true", help="only the learner step's memory (part 4)"
    )
    args = parser.parse_args()
    if args.memory:
        with tempfile.TemporaryDirectory() as scratch:
            memory(model_folder(args.quick, scratch), *MEMORY_BATCH[args.quick])
        return
    threads = sorted({int(t) for t in args.threads.split(",")})
    seconds = 0.5 if args.quick else 3.0
    shapes = [(512, 512, 512)]
    if not args.quick:
        # square products, and SmolLM2's MLP up-projection over 512 tokens
        shapes += [(1024, 1024, 1024), (2048, 2048, 2048), (512, 576, 1536)]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"\nmatrix products (m x k x n, best of {seconds:.1f} s): GFLOP per wall s / per CPU s")
    peak = {}
    for name, dtype in DTYPES.items():
        for count in threads:
            torch.set_num_threads(count)
            flops = [matmul_flops(shape, dtype, seconds) for shape in shapes]
            peak[name, count] = (max(f[0] for f in flops), max(f[1] for f in flops))
            print(f"{name:>9}, {count} thread(s):")
            for shape, (wall, cpu) in zip(shapes, flops, strict=True):
                size = "x".join(map(str, shape))
                print(f"{'':>11}{size:<15} {wall / 1e9:7.1f} / {cpu / 1e9:7.1f}")
    dtypes = [d for d in args.dtypes.split(",") if d] or ["float32"]
    # per CPU second: the figure other jobs on the machine move least
    best = {name: max(peak[name, t][1] for t in threads) for name in DTYPES}
    if not args.dtypes and best["bfloat16"] > best["float32"]:
        dtypes.append("bfloat16")
    rows, tokens, steps = (2, 32, 1) if args.quick else (4, 128, 2)
    prompts, prompt_tokens, new_tokens = (2, 16, 8) if args.quick else (8, 64, 32)
    with tempfile.TemporaryDirectory() as scratch:
        path = model_folder(args.quick, scratch)
        if args.quick:
            print("\n--quick: a random model of SmolLM2-135M's shape with 4 of its 30 layers")
        print(
            f"\nSmolLM2-135M: learner {rows} x {tokens} tokens a step; engine {prompts} prompts "
            f"of {prompt_tokens} tokens, {new_tokens} new each. Model GFLOP per wall s / per CPU "
            f"s (MFU: the fraction of the same dtype's and threads' matrix-product peak, per CPU s)"
        )
        for name in dtypes:
            for count in threads:
                torch.set_num_threads(count)
                limit = peak[name, count][1]
                figures = {"learner": learner_flops(path, DTYPES[name], rows, tokens, steps)}
                figures |= engine_flops(path, DTYPES[name], prompts, prompt_tokens, new_tokens)
                print(f"{name:>9}, {count} thread(s):")
                for part, (wall, cpu) in figures.items():
                    if part == "new tokens":
                        print(f"{'':>11}{part:<10} {wall:7.1f} / s wall, {cpu:7.1f} / CPU s")
                        continue
                    print(
                        f"{'':>11}{part:<10} {wall / 1e9:7.1f} / {cpu / 1e9:7.1f} "
                        f"(MFU {cpu / limit:.0%})"
                    )
        memory(path, *MEMORY_BATCH[args.quick])


def memory(path: str, rows: int, tokens: int) -> None:
    """Print part 4: a learner step's resident peak, the output layer in chunks and whole."""
    chunked = learner_peak_mb(path, rows, tokens, chunked=True)
    if chunked is None:
        print("\nno /proc here: the learner step's memory is not measured")
        return
    whole = learner_peak_mb(path, rows, tokens, chunked=False)
    print(
        f"\nlearner step's resident peak over the model and its gradients ({rows} x {tokens} "
        f"tokens, float32): output layer in chunks {chunked:.0f} MB, whole logits {whole:.0f} MB"
    )


if __name__ == "__main__":
    main()
