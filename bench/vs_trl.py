"""molt-wb vs TRL's GRPOTrainer: the same policy, task and batch, trained one after the other.

    pip install -e '.[bench]'
    python bench/vs_trl.py [--quick] [--steps N] [--seeds 0-5] [--target 0.75] [override ...]
    python bench/vs_trl.py --model smollm2-135m --task gcd [...]   # the real model (#43)
    python bench/vs_trl.py --seeds 0-3 --results FILE [...]   # resumable: sides in FILE are kept

Both sides train the arith recipe's warm-started tiny Qwen3 (built offline, same checkpoint) on the
recipe's data and reward (plugins/arith.py) or, with `--model smollm2-135m --task TASK`, the
real SmolLM2-135M-Instruct on the recipe `smol_TASK` (a reasoning-gym task, its env_kwargs and
reward: plugins/reasoning_gym.py), with the same group size, prompts per step, completion
length, learning rate (constant), clip, temperature and number of steps, GRPO advantages (group std)
and a token-mean loss, no KL term, on the CPU: molt-wb through `loop.train` (Ray actors, run store,
gate), TRL through `GRPOTrainer` (no vLLM, no hub, report_to none). Each side runs in its own child
process, so peak memory is that process tree's (Ray's processes included), sampled by the parent:
RSS (which counts shared library pages once per process) and PSS (which splits them among the
processes that map them). molt-wb runs twice: synchronous (the recipe as it is) and with rollout
one version ahead of the learner (`trainer.async_depth=1`, token-level version gate), so generation
and training overlap.
TRL runs twice: as shipped, and with OMP_WAIT_POLICY=PASSIVE (what molt-wb sets for its Ray actors),
so the ratio shows what is framework and what is that setting. Step times exclude start-up and the
first (warm-up) step; generated tokens are sampled completion tokens (stop token included) on both
sides. Prints each side and the ratios molt-wb / TRL; reward per minute is the reward the steady
steps earned (mean reward x episodes) over their wall-clock minutes.

Speed at equal reward: each side's training time until its reward, averaged over 5 steps, first
reaches `--target` (time to target: the steps' own times, the warm-up step counted at the steady
mean). With `--seeds`, every side but TRL+passive runs once per seed (each seed warm-starts its own
checkpoint), and the means over the seeds are compared.

`--quick` (a smoke run) trains 2 steps of synchronous molt-wb and of TRL as shipped only.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# rollout one version ahead, overlapping the learner; gated
ASYNC = [
    "trainer.async_depth=1",
    "gate.level=token",
]
OFFLINE = {
    "PYTHONWARNINGS": "ignore",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def config(steps: int, extra: list[str], root: str = "runs"):
    from workbench.config import compose_config

    # the arith recipe unless the overrides name one (--model smollm2-135m --task TASK)
    recipe = [] if any(o.startswith("+recipe=") for o in extra) else ["+recipe=arith"]
    return compose_config(
        [
            *recipe,
            f"trainer.steps={steps}",
            "tracking=none",
            "run.progress=false",
            "trainer.checkpoint_every=0",
            f"run.root={root}",
            *extra,
        ]
    )


def run_molt(steps: int, extra: list[str], model_path: str) -> dict:
    from workbench.run import loop
    from workbench.store import open_run

    with tempfile.TemporaryDirectory() as root:
        cfg = config(steps, [*extra, f"model.path={model_path}", "run.id=molt"], root)
        start = time.perf_counter()
        run_id = loop.train(cfg)
        wall = time.perf_counter() - start
        rows = (
            open_run(run_id, root)
            .execute(
                "pivot (select step, key, value from metrics where key in "
                "('perf/step_s', 'rollout/sampled_tokens', 'reward/mean')) "
                "on key using first(value) order by step"
            )
            .fetchall()
        )
    return {
        "wall_s": wall,
        "episodes": cfg.trainer.prompts_per_step * cfg.trainer.group_size,
        "step_s": [r[1] for r in rows],
        "tokens": [r[3] for r in rows],
        "reward": [r[2] for r in rows],
    }


def run_trl(steps: int, extra: list[str], model_path: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from workbench.api import load_plugin
    from workbench.models.lora import peft_config

    cfg = config(steps, extra)
    plugin = load_plugin(cfg.agent.plugin, cfg.agent.env_kwargs)
    samples = plugin.make_dataset(cfg.data.size, cfg.seed)
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": plugin.AgentRunner().reset(s)}],
                "sample": json.dumps(s),
            }
            for s in samples
        ]
    )

    # the recipe's own Env grades each completion
    def reward(prompts, completions, sample, **_) -> list[float]:
        scores = []
        for completion, row in zip(completions, sample, strict=True):
            env = plugin.AgentRunner()
            env.reset(json.loads(row))
            scores.append(env.step(completion[-1]["content"]).reward)
        return scores

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_s = []
            self.logs = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.mark)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(logs)

    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # molt-wb's engine stops at the tokenizer's EOS; so does TRL's generation config here
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    group = cfg.trainer.group_size
    prompts = cfg.trainer.prompts_per_step
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=group * prompts,
            num_generations=group,
            max_completion_length=cfg.engine.max_tokens,
            temperature=cfg.engine.temperature,
            top_p=cfg.engine.top_p,
            learning_rate=cfg.trainer.lr,
            lr_scheduler_type="constant",
            weight_decay=cfg.trainer.weight_decay,
            max_grad_norm=cfg.trainer.max_grad_norm,
            epsilon=cfg.algo.clip_low,
            epsilon_high=cfg.algo.clip_high,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="group",
            num_iterations=1,
            use_cpu=True,
            bf16=False,
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=cfg.seed,
            dataloader_num_workers=0,
        )
        clock = Clock()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[clock],
            # the recipe's LoRA adapter, as molt-wb builds it (None: full fine-tuning)
            peft_config=peft_config(cfg.model.lora) if cfg.model.lora.rank else None,
        )
        trainer.remove_callback(PrinterCallback)  # its per-step log dicts; the Clock keeps them
        trainer.train()
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "episodes": group * prompts,
        "step_s": clock.step_s,
        "reward": [log["reward"] for log in clock.logs],
        "tokens": [log["completions/mean_length"] * group * prompts for log in clock.logs],
    }


def measure(side: str, steps: int, extra: list[str], model_path: str, env: dict) -> dict:
    """Run one side in a child process; add the peak RSS and PSS of its process tree. Sampling must
    not load the cores it measures: RSS every 0.1 s (cheap), the tree's processes found again once a
    second, and PSS (which reads every mapping, ~10 ms a process) only when the RSS reaches a new
    high, which it does while the side starts up, not in the steady steps timed."""
    import psutil

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--side",
                side,
                "--json",
                out.name,
                "--model-path",
                model_path,
                "--steps",
                str(steps),
                *extra,
            ],
            env={**os.environ, **OFFLINE, **env},
        )
        parent = psutil.Process(child.pid)
        tree = []
        tick = 0
        peak = 0
        peak_pss = 0
        pss_at = 0  # the tree's RSS when its PSS was last read
        while child.poll() is None:
            try:
                if tick % 10 == 0:
                    tree = [parent, *parent.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree if p.is_running())
                peak = max(peak, rss)
                # a new high: PSS splits shared pages among the processes that map them
                if rss > pss_at * 1.02:
                    pss = sum(p.memory_full_info().pss for p in tree if p.is_running())
                    peak_pss = max(peak_pss, pss)
                    pss_at = rss
            except psutil.Error:
                pass
            tick += 1
            time.sleep(0.1)
        if child.returncode:
            raise SystemExit(
                f"The {side} run failed (exit {child.returncode}); its output is above."
            )
        result = json.loads(Path(out.name).read_text())
    result["peak_rss_mb"] = peak / 2**20
    result["peak_pss_mb"] = peak_pss / 2**20
    return result


def summary(r: dict, target: float = 0.75, window: int = 5) -> dict:
    steady = r["step_s"][1:] or r["step_s"]  # the first step warms up
    tokens = sum(r["tokens"][1:] or r["tokens"])
    # the reward the steady steps earned: mean reward x episodes a step
    earned = sum(r["reward"][1:] or r["reward"]) * r["episodes"]
    k = max(1, len(r["reward"]) // 5)
    # the warm-up step at the steady mean: its extra is start-up
    times = [sum(steady) / len(steady), *r["step_s"][1:]]
    reached = next(
        (
            end
            for end in range(window, len(r["reward"]) + 1)
            if sum(r["reward"][end - window : end]) / window >= target
        ),
        None,
    )
    return {
        "step_s": sum(steady) / len(steady),
        "tokens_per_s": tokens / sum(steady),
        "reward_per_min": earned / (sum(steady) / 60),
        "wall_s": r["wall_s"],
        "peak_rss_mb": r["peak_rss_mb"],
        "peak_pss_mb": r["peak_pss_mb"],
        "reward_first": sum(r["reward"][:k]) / k,
        "reward_last": sum(r["reward"][-k:]) / k,
        "steps_to_target": reached,
        "s_to_target": sum(times[:reached]) if reached else None,
    }


def seed_list(text: str) -> list[int]:
    """'3' -> [3]; '0-5' -> [0..5]; '0,2,7' -> [0, 2, 7]."""
    first, _, last = text.partition("-")
    if last:
        return list(range(int(first), int(last) + 1))
    return [int(x) for x in text.split(",")]


def seconds_or_dash(seconds: float | None) -> str:
    """Seconds to target in an 11-column cell, or '-' where the target was never reached."""
    if seconds:
        return f"{seconds:11.2f}"
    return f"{'-':>11}"


def saved_results(path: str | None, steps: int, overrides: list[str]) -> dict:
    """The raw results already in `path` ({"seed side": result}), for the same steps and
    overrides; {} where there is no file yet. A file of other settings is refused."""
    if not path or not Path(path).exists():
        return {}
    saved = json.loads(Path(path).read_text())
    if saved["steps"] != steps or saved["overrides"] != overrides:
        raise SystemExit(
            f"{path} holds runs of {saved['steps']} steps with {saved['overrides']}: give another "
            f"--results file for {steps} steps with {overrides}."
        )
    return saved["results"]


def compare_seeds(
    seeds: list[int], steps: int, overrides: list[str], target: float, results: str | None = None
) -> None:
    """Every side once per seed; per seed and mean: tokens/s, last reward, time to target; ratios
    over TRL. With `results`, each side's raw result is kept in that JSON file as it ends, and a
    side already there is read back instead of run again: a comparison of hours goes on where it
    stopped."""
    from workbench.run import model_paths

    sides = {"molt-wb": ("molt", []), "molt-wb async": ("molt", ASYNC), "TRL": ("trl", [])}
    table = {name: [] for name in sides}
    done = saved_results(results, steps, overrides)
    print(
        f"{'seed':>4} {'side':>14} {'step_s':>7} {'tokens/s':>9} {'reward/min':>10} {'PSS_MB':>7} "
        f"{'reward first':>12} {'reward last':>11} {'steps to target':>15} {'s to target':>11} "
        f"{'load':>9}"
    )
    for seed in seeds:
        extra = [*overrides, f"seed={seed}"]
        model_path = model_paths.policy_path(config(steps, extra))
        for name, (side, more) in sides.items():
            key = f"{seed} {name}"
            if key not in done:
                # the 1-minute load average before and after: other jobs on the cores show here
                before = os.getloadavg()[0]
                done[key] = measure(side, steps, [*extra, *more], model_path, {})
                done[key]["load"] = [before, os.getloadavg()[0]]
                if results:
                    record = {"steps": steps, "overrides": overrides, "results": done}
                    Path(results).write_text(json.dumps(record, indent=1))
            s = summary(done[key], target)
            table[name].append(s)
            load = "{:.1f}-{:.1f}".format(*done[key]["load"])
            print(
                f"{seed:>4} {name:>14} {s['step_s']:7.2f} {s['tokens_per_s']:9.1f} "
                f"{s['reward_per_min']:10.2f} {s['peak_pss_mb']:7.0f} {s['reward_first']:12.3f} "
                f"{s['reward_last']:11.3f} "
                f"{s['steps_to_target'] or '-':>15} {seconds_or_dash(s['s_to_target'])} "
                f"{load:>9}",
                flush=True,
            )

    # the seeds where every side reached the target
    both = []
    for i in range(len(seeds)):
        if all(table[name][i]["s_to_target"] for name in sides):
            both.append(i)

    def mean(name: str, key: str) -> float:
        rows = table[name]
        if key.endswith("to_target"):
            rows = [table[name][i] for i in both]
        if not rows:
            return float("nan")
        return sum(s[key] for s in rows) / len(rows)

    print(
        f"mean over seeds {','.join(map(str, seeds))}; to target (reward {target} over 5 steps): "
        f"mean over the {len(both)} seeds where every side reached it"
    )
    print(
        f"{'side':>14} {'step_s':>7} {'tokens/s':>9} {'reward/min':>10} {'PSS_MB':>7} "
        f"{'reward first':>12} {'reward last':>11} {'reached':>7} {'steps to target':>15} "
        f"{'s to target':>11} {'tokens/s / TRL':>14} {'TRL s / s, to target':>20}"
    )
    for name in sides:
        reached = sum(s["s_to_target"] is not None for s in table[name])
        print(
            f"{name:>14} {mean(name, 'step_s'):7.2f} {mean(name, 'tokens_per_s'):9.1f} "
            f"{mean(name, 'reward_per_min'):10.2f} {mean(name, 'peak_pss_mb'):7.0f} "
            f"{mean(name, 'reward_first'):12.3f} {mean(name, 'reward_last'):11.3f} "
            f"{reached:>4}/{len(seeds):<2} "
            f"{mean(name, 'steps_to_target'):15.1f} {mean(name, 's_to_target'):11.2f} "
            f"{mean(name, 'tokens_per_s') / mean('TRL', 'tokens_per_s'):14.2f} "
            f"{mean('TRL', 's_to_target') / mean(name, 's_to_target'):20.2f}"
        )


def ratios(molt: dict, trl: dict) -> str:
    """molt-wb / TRL of step time, tokens/s, reward per minute, wall, peak RSS and PSS, in the
    table's columns."""
    return (
        f"{molt['step_s'] / trl['step_s']:7.2f} {molt['tokens_per_s'] / trl['tokens_per_s']:9.2f} "
        f"{molt['reward_per_min'] / max(trl['reward_per_min'], 1e-9):10.2f} "
        f"{molt['wall_s'] / trl['wall_s']:7.2f} {molt['peak_rss_mb'] / trl['peak_rss_mb']:8.2f} "
        f"{molt['peak_pss_mb'] / trl['peak_pss_mb']:7.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--quick", action="store_true", help="2 steps of molt-wb and TRL only: a smoke run"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--seeds",
        help="run every side once per seed, e.g. 0-5 or 0,3 (default: the recipe's seed only)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.75,
        help="the reward (mean over 5 steps) timed to (default 0.75)",
    )
    parser.add_argument(
        "--model", help="a pretrained model (smollm2-135m); default the arith recipe's tiny one"
    )
    parser.add_argument(
        "--task", default="gcd", help="with --model: the recipe smol_TASK's task (default gcd)"
    )
    parser.add_argument(
        "--results",
        help="with --seeds: a JSON file that keeps each side's result as it ends; sides already "
        "in it are read back, not run again",
    )
    parser.add_argument("--side", choices=("molt", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides (applied to both sides)"
    )
    args = parser.parse_args()
    steps = 2 if args.quick else args.steps
    if args.model:
        args.overrides = [f"+recipe=smol_{args.task}", f"model={args.model}", *args.overrides]
    if args.side:
        run_side = {"molt": run_molt, "trl": run_trl}[args.side]
        result = run_side(steps, args.overrides, args.model_path)
        Path(args.json).write_text(json.dumps(result))
        return
    if args.seeds:
        compare_seeds(seed_list(args.seeds), steps, args.overrides, args.target, args.results)
        return
    from workbench.run import model_paths

    # the warm start, built (once) before either side
    model_path = model_paths.policy_path(config(steps, args.overrides))
    sides = {
        "molt-wb": ("molt", {}, []),
        "molt-wb async": ("molt", {}, ASYNC),
        "TRL": ("trl", {}, []),
        "TRL+passive": ("trl", {"OMP_WAIT_POLICY": "PASSIVE"}, []),
    }
    if args.quick:
        sides.pop("molt-wb async")
        sides.pop("TRL+passive")
    results = {
        name: measure(side, steps, [*args.overrides, *more], model_path, env)
        for name, (side, env, more) in sides.items()
    }
    summaries = {name: summary(r, args.target) for name, r in results.items()}
    print(
        f"{steps} steps of {config(steps, args.overrides).trainer.prompts_per_step} prompts x "
        f"{config(steps, args.overrides).trainer.group_size} samples, {os.cpu_count()} CPU cores"
    )
    print(
        f"{'':>26} {'step_s':>7} {'tokens/s':>9} {'reward/min':>10} {'wall_s':>7} {'peak_MB':>8} "
        f"{'PSS_MB':>7} "
        f"{'reward first':>12} {'reward last':>11} {'s to target':>11}"
    )
    for name, s in summaries.items():
        print(
            f"{name:>26} {s['step_s']:7.3f} {s['tokens_per_s']:9.1f} {s['reward_per_min']:10.2f} "
            f"{s['wall_s']:7.1f} "
            f"{s['peak_rss_mb']:8.0f} {s['peak_pss_mb']:7.0f} {s['reward_first']:12.3f} "
            f"{s['reward_last']:11.3f} {seconds_or_dash(s['s_to_target'])}"
        )
    ours_names = [n for n in summaries if n.startswith("molt-wb")]
    trl_names = [n for n in summaries if n.startswith("TRL")]
    for ours in ours_names:
        for name in trl_names:
            print(f"{ours + ' / ' + name:>26} " + ratios(summaries[ours], summaries[name]))
    print(
        "reward first / last: mean over the first / last fifth of the steps; s to target: training "
        f"seconds until the reward over 5 steps first reaches {args.target}"
    )
    for name, r in results.items():
        print(f"reward curve {name:>13}: " + " ".join(f"{x:.2f}" for x in r["reward"]))


if __name__ == "__main__":
    main()
