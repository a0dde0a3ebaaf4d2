"""The docs site's generated reference pages: every config key and every run-store column.

The config page is read from the dataclasses of `workbench/config.py` (each field's docstring) and
the presets under `conf/`; the store page from the Arrow schemas of `workbench/store/schema.py`
and the column descriptions below. `docs/hooks.py` renders both at build time, so a new key or
column without a description stops `mkdocs build` (and `tests/test_docs.py`) with a sentence
naming it.
"""

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from workbench import config as config_module
from workbench.store import schema

REPO = Path(__file__).resolve().parent.parent.parent
CONF = REPO / "conf"


class ReferenceError(ValueError):
    """A key or column the reference cannot describe; the message says what to add."""


# ---- config keys


def field_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, by field name (as Python's own attribute
    docstring convention places it: a string statement right after the annotated assignment)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:], strict=False):
        if not isinstance(statement, ast.AnnAssign):
            continue
        if not isinstance(following, ast.Expr):
            continue
        if not isinstance(following.value, ast.Constant):
            continue
        # one line: the docstring's lines joined, its indentation dropped
        docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def default_text(value: Any) -> str:
    """A field's default as a reader writes it on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def config_keys(cls: type = config_module.Config, prefix: str = "") -> list[dict[str, str]]:
    """Every leaf key of the config under `cls`, in declaration order: key, type, default, doc.

    Raises ReferenceError for a leaf field without a docstring."""
    docs = field_docstrings(cls)
    instance = cls()
    keys = []
    for item in dataclasses.fields(cls):
        key = prefix + item.name
        value = getattr(instance, item.name)
        if dataclasses.is_dataclass(value):
            keys += config_keys(type(value), key + ".")
            continue
        if item.name not in docs:
            raise ReferenceError(
                f"Config key {key} has no docstring: add a string under the field "
                f"{cls.__name__}.{item.name} in workbench/config.py saying what it does."
            )
        annotation = (
            item.type if isinstance(item.type, str) else inspect.formatannotation(item.type)
        )
        keys.append(
            {"key": key, "type": annotation, "default": default_text(value), "doc": docs[item.name]}
        )
    return keys


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def preset_summary(preset: Path) -> str:
    """What a preset file sets: the first sentence of its leading comment, else its keys (under
    its group, unless the file is `# @package _global_`)."""
    comment = []
    for line in preset.read_text().splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            comment.append(line.lstrip("#").strip())
    text = " ".join(comment)
    if text:
        # the first sentence
        return text.split(". ")[0].rstrip(".") + "."
    values = OmegaConf.to_container(OmegaConf.load(preset))
    group = "" if "@package _global_" in preset.read_text() else preset.parent.name + "."
    pairs = [f"{group}{key}={value}" for key, value in flatten(values)]
    return ", ".join(f"`{pair}`" for pair in pairs)


def flatten(values: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested dict."""
    pairs = []
    for key, value in values.items():
        if isinstance(value, dict):
            pairs += flatten(value, f"{prefix}{key}.")
        else:
            pairs.append((f"{prefix}{key}", value))
    return pairs


def presets() -> dict[str, list[tuple[str, str]]]:
    """Each config group's presets under conf/: (name, what it sets)."""
    groups = {}
    for folder in sorted(path for path in CONF.iterdir() if path.is_dir()):
        groups[folder.name] = [(p.stem, preset_summary(p)) for p in sorted(folder.glob("*.yaml"))]
    return groups


def config_page() -> str:
    """The Markdown of docs/reference/config.md."""
    lines = [
        "# Every config key",
        "",
        "Generated from the dataclasses of `workbench/config.py` (a docstring under every",
        "field) and the presets under `conf/` each time the site is built: a key without a",
        "docstring stops the build. Set any key on the command line (`molt-wb train +recipe=arith",
        "trainer.steps=5 engine.temperature=0.8`); a group's preset picks several at once",
        "(`gate=geo`, `model=tiny-moe`). Keys of the same group are refused together at start-up",
        "when they combine unsafely, each with one sentence naming the fix.",
        "",
        "## Presets",
        "",
        "| group | preset | what it sets |",
        "| --- | --- | --- |",
    ]
    for group, rows in presets().items():
        for name, comment in rows:
            lines.append(f"| `{group}` | `{name}` | {cell(comment)} |")
    lines.append("")
    sections: dict[str, list[dict[str, str]]] = {}
    for key in config_keys():
        group = key["key"].split(".")[0] if "." in key["key"] else "top level"
        sections.setdefault(group, []).append(key)
    for group, keys in sections.items():
        lines += [
            f"## {group}",
            "",
            "| key | type | default | what it does |",
            "| --- | --- | --- | --- |",
        ]
        for key in keys:
            row = [f"`{key['key']}`", f"`{cell(key['type'])}`", f"`{cell(key['default'])}`"]
            lines.append("| " + " | ".join(row) + f" | {cell(key['doc'])} |")
        lines.append("")
    return "\n".join(lines)


# ---- run-store tables

# one row per ..., and each column's meaning; a column of a schema missing here stops the build
TABLES: dict[str, tuple[str, dict[str, str]]] = {
    "segments": (
        "segment: one token-exact piece of an episode",
        {
            "run_id": "the run",
            "step": "the loop step whose batch held the segment",
            "rollout_id": "the episode (a rollout); several segments of one episode share it",
            "segment_idx": "the segment's index within its episode (a seal opens the next)",
            "group_id": "the prompt's group: the samples of one prompt share the baseline",
            "reward": "the episode's reward",
            "advantage": "the segment's advantage (the mean over its sampled tokens where the "
            "estimator gives one per token)",
            "num_tokens": "tokens in the segment, prompt included",
            "num_sampled": "tokens the policy sampled (loss mask 1)",
            "min_version": "oldest weight version among its sampled tokens",
            "max_version": "newest weight version among its sampled tokens (a partial rollout "
            "spans several)",
            "learner_version": "the learner's version when it trained on the segment",
            "finish_reason": "why the last turn ended: stop, length, ...",
            "seal_reason": "why the segment was sealed, if it was: compaction, tools_changed or "
            "template_rewrite",
            "turn_spans": "[start, end) token positions of each sampled turn",
            "turn_rewards": "the episode's reward of each sampled turn, in order "
            "(`tokens.turn` indexes it)",
            "prompt_text": "the first prompt, decoded (display only, never training input)",
            "response_text": "the sampled text, decoded (display only)",
            "images": "the segment's images: files under `runs/<id>/images/`",
            "info": "JSON: the episode's last `Result.info` (a judge's prompt and verdict, ...)",
        },
    ),
    "tokens": (
        "token",
        {
            "run_id": "the run",
            "step": "the loop step",
            "rollout_id": "the token's episode",
            "segment_idx": "the token's segment within its episode",
            "position": "the token's position in its segment",
            "token_id": "the id, exactly as sampled or rendered",
            "loss_mask": "1 where the policy sampled the token, 0 for prompt, environment and "
            "forced tokens",
            "behavior_logprob": "log-prob under the policy that sampled it (0 where not sampled)",
            "train_logprob": "log-prob the learner recomputed (π_old)",
            "behavior_version": "weight version that sampled it (-1 where not sampled, -2 forced)",
            "is_weight": "the version gate's importance weight (0 where masked)",
            "advantage": "the token's advantage (its own under a per-token estimator, else its "
            "segment's)",
            "entropy": "entropy of π_old's distribution the token was drawn from, at the engine's "
            "temperature; null where the learner computed none",
            "turn": "the episode's index of the token's sampled turn; null outside them",
            "gap_staleness": "the off-policy gap's part from weight versions: π_old less the "
            "learner's log-prob under the sampling version (docs/off-policy-gap.md); null where "
            "not measured",
            "gap_routing": "the gap's part from MoE routing: π_old less the replay-on forward "
            "(0 under replay and for a dense policy); null where not measured",
            "gap_sampler": "the gap's part from the sampler's truncation (engine.top_p): raw less "
            "processed log-prob; null where not measured",
            "gap_numerics": "the gap's rest, the two implementations' disagreement: "
            "train_logprob − behavior_logprob less the other three parts; null where not measured",
        },
    ),
    "metrics": (
        "(step, key)",
        {
            "run_id": "the run",
            "step": "the loop step",
            "key": "the metric's namespaced key (`reward/mean`, `gate/kept_frac`, ...)",
            "value": "its value",
            "time": "Unix time it was logged",
        },
    ),
    "gate_decisions": (
        "sequence the version gate judged",
        {
            "run_id": "the run",
            "step": "the loop step",
            "rollout_id": "the segment's episode",
            "segment_idx": "the segment within its episode",
            "learner_version": "the learner's version at the decision",
            "min_version": "oldest version among the segment's sampled tokens",
            "max_version": "newest version among them",
            "staleness": "learner version minus the oldest sampled token's",
            "seq_log_ratio": "Σδ over the sampled tokens, δ = log π_old − log π_behavior",
            "geo_ratio": "e^(mean δ)",
            "decision": "kept or dropped",
            "reason": "ok, stale, ratio_low, ratio_high or veto",
            "tokens_masked": "sampled tokens given weight 0",
        },
    ),
    "requests": (
        "request to the loopback server",
        {
            "run_id": "the run",
            "step": "the loop step",
            "session": "the episode's session id",
            "rollout_id": "the episode",
            "wire": "openai (Chat Completions), anthropic (Messages) or responses (OpenAI "
            "Responses)",
            "stream": "whether the reply was streamed",
            "action": "open, extend or seal: what the request did to the session's segment",
            "prompt_tokens_reused": "prompt tokens already in the segment",
            "new_prompt_tokens": "prompt tokens the request added",
            "generated_tokens": "tokens sampled for the reply",
            "latency_s": "seconds from the request to its reply",
            "time": "Unix time of the request",
        },
    ),
    "routing": (
        "(segment, MoE layer)",
        {
            "run_id": "the run",
            "step": "the loop step",
            "rollout_id": "the segment's episode",
            "segment_idx": "the segment within its episode",
            "layer": "the MoE layer",
            "tokens": "tokens compared",
            "mismatched": "tokens whose live top-k differed from the rollout's",
            "positions": "their positions",
            "rollout_experts": "the rollout's experts at each mismatched position",
            "learner_experts": "the learner's experts at each mismatched position",
        },
    ),
    "failed_episodes": (
        "episode that never reached a batch",
        {
            "run_id": "the run",
            "step": "the loop step",
            "rollout_id": "the episode",
            "group_id": "its prompt's group",
            "worker": "the rollout worker that ran it",
            "kind": "env_error, agent_error, worker_died or timeout",
            "error": "the error in one line",
            "traceback": "the traceback, where there was one",
            "time": "Unix time of the failure",
        },
    ),
    "eval": (
        "evaluation of the held-out split",
        {
            "run_id": "the run",
            "step": "the loop step whose weights were scored (-1: the starting policy)",
            "checkpoint": "the checkpoint scored, if any",
            "split": "the split scored",
            "n": "episodes scored",
            "mean_reward": "their mean reward",
            "accuracy": "share of episodes with reward at least `eval.threshold`",
            "time": "Unix time of the evaluation",
        },
    ),
    "alarms": (
        "run-health rule that fired (workbench/store/alarms.py)",
        {
            "run_id": "the run",
            "step": "the loop step at which the rule's condition started to hold",
            "rule": "kl_acceleration, entropy_collapse, length_drift, tool_call_shift, "
            "reward_without_correctness, seals or identity_violations",
            "metric": "the metric the rule read",
            "value": "what the rule measured (a window's mean, a rise, a step's value)",
            "threshold": "the bound it crossed, from its `alarm.*` key",
            "evidence": "the firing in one sentence: the windows' steps and means",
            "time": "Unix time it fired",
        },
    ),
}


def store_page() -> str:
    """The Markdown of docs/reference/store.md; raises ReferenceError where a table or column of
    `workbench.store.schema.TABLES` has no description here, or a description names none."""
    missing_tables = set(schema.TABLES) - set(TABLES)
    if missing_tables:
        raise ReferenceError(
            f"Store table {sorted(missing_tables)[0]} has no description: add it to TABLES in "
            f"docs/gen/reference.py."
        )
    lines = [
        "# Run-store tables",
        "",
        "Generated from the Arrow schemas of `workbench/store/schema.py` each time the site is",
        "built: a column without a description stops the build. Each table is a folder of Parquet",
        "shards under `runs/<run_id>/`; `workbench.store.open_run(RUN_ID)` opens them all as",
        "DuckDB views (see [The run store](../run-store.md)).",
        "",
    ]
    for name, arrow_schema in schema.TABLES.items():
        per_row, columns = TABLES[name]
        extra = set(columns) - set(arrow_schema.names)
        if extra:
            raise ReferenceError(
                f"docs/gen/reference.py describes {name}.{sorted(extra)[0]}, which "
                f"workbench/store/schema.py does not have: remove it."
            )
        lines += [
            f"## `{name}`",
            "",
            f"One row per {per_row}.",
            "",
            "| column | type | meaning |",
            "| --- | --- | --- |",
        ]
        for column in arrow_schema:
            if column.name not in columns:
                raise ReferenceError(
                    f"Store column {name}.{column.name} has no description: add it to TABLES in "
                    f"docs/gen/reference.py."
                )
            lines.append(f"| `{column.name}` | `{column.type}` | {cell(columns[column.name])} |")
        lines.append("")
    return "\n".join(lines)


# the pages docs/hooks.py adds to the site, by path under docs/
PAGES = {"reference/config.md": config_page, "reference/store.md": store_page}
