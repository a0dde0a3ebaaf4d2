"""Config composition: defaults, recipes, overrides, sweeps, and refusals at start-up."""

import pytest

from workbench.algo.advantages import ADVANTAGES
from workbench.algo.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from workbench.config import ConfigError, compose_config, expand_sweep


def test_defaults_compose_with_the_documented_keys():
    cfg = compose_config([])
    assert (
        cfg.seed == 0 and cfg.trainer.steps == 20 and cfg.run.root == "runs" and cfg.run.id is None
    )
    assert cfg.model.name == "tiny" and cfg.engine.name == "torch" and cfg.agent.plugin == "arith"
    assert cfg.gate.level == "off" and cfg.tracking.wandb.mode == "offline"


def test_recipe_sets_its_values_and_the_command_line_wins_over_it():
    cfg = compose_config(["+recipe=arith"])
    assert cfg.recipe == "arith" and cfg.trainer.steps == 80 and cfg.model.warm_start_steps == 600
    cfg = compose_config(
        ["+recipe=arith", "trainer.steps=5", "seed=3", "run.id=abc", "engine.temperature=0.7"]
    )
    assert (cfg.trainer.steps, cfg.seed, cfg.run.id, cfg.engine.temperature) == (5, 3, "abc", 0.7)


def test_group_options_select_presets():
    assert compose_config(["tracking=none"]).tracking.wandb.mode == "disabled"
    assert compose_config(["algo=rloo"]).algo.advantage == "rloo"
    assert compose_config(["algo=gspo"]).algo.policy_loss == "gspo"
    assert compose_config(["gate=geo", "trainer.async_depth=1"]).gate.level == "geo"
    assert compose_config(["ray=cluster"]).ray.address == "auto"
    assert compose_config(["model=small"]).model.name == "small"


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.stepz=3", "Bad config override"),
        ("+recipe=nope", "Bad config override"),
        ("trainer.steps=abc", "Bad config override"),
        ("engine.temperature=0", "engine.temperature"),
        ("algo.advantage=ppo", "algo.advantage"),
        ("trainer.group_size=1", "trainer.group_size"),
        ("algo.aggregation=constant", "constant_denominator"),
        ("trainer.async_depth=2", "gate.level=token, seq or geo"),
        ("rollout.partial=true", "gate.level=token, seq or geo"),
        ("gate.level=token", "engine.top_p=1"),
        ("gate.level=geo gate.mode=clip", "unset gate.mode"),
        ("gate.band=[2.0,0.5]", "gate.band"),
        ("trainer.timeout_s=0", "trainer.timeout_s"),
        ("algo.turn_discount=0.9", "set algo.advantage=turn or algo.turn_discount=1"),
        ("algo.advantage=turn algo.turn_discount=1.5", "algo.turn_discount must be between 0"),
        ("gate.level=tokens", "gate.level=tokens is unknown"),
        ("engine.name=sglang", "engine=sglang is unknown"),
        ("agent.history_rewrite=merge", "agent.history_rewrite=merge is unknown: use seal or"),
        # not installed, or no image prompts: one sentence either way
        ("engine=vllm +recipe=geo3k", "engine=vllm"),
        (
            "engine=vllm model=tiny-moe algo.routing_replay=true rollout.partial=true "
            "gate.level=token",
            "set rollout.partial=false or use engine=torch",
        ),
    ],
)
def test_bad_config_is_one_sentence_naming_the_key(override, words):
    with pytest.raises(ConfigError) as error:
        compose_config(
            {"gate.level=token": [override, "engine.top_p=0.9"]}.get(override, override.split())
        )
    message = str(error.value)
    assert words in message and "\n" not in message


def test_multirun_line_expands_to_every_combination():
    jobs = [job for job, _ in expand_sweep(["+recipe=arith", "trainer.lr=1e-3,2e-3", "seed=0,1,2"])]
    assert len(jobs) == 6
    assert {tuple(sorted(j)) for j in jobs} == {
        tuple(sorted(["+recipe=arith", f"trainer.lr={lr}", f"seed={s}"]))
        for lr in ("0.001", "0.002")
        for s in (0, 1, 2)
    }
    assert [compose_config(j).seed for j in jobs[:3]] == [0, 1, 2]


def test_sweep_grammar_lists_ranges_and_swept_values():
    jobs = expand_sweep(
        ["+recipe=arith", "gate.level=token", "gate.band=[0.5,2.0],[0.9,1.1]", "seed=range(0,3)"]
    )
    assert len(jobs) == 6
    swept = [values for _, values in jobs]
    assert {v["gate.band"] for v in swept} == {"[0.5,2.0]", "[0.9,1.1]"} and {
        v["seed"] for v in swept
    } == {"0", "1", "2"}
    assert all(set(v) == {"gate.band", "seed"} for v in swept)  # fixed keys are not "swept"
    bands = {tuple(compose_config(job).gate.band) for job, _ in jobs}
    assert bands == {(0.5, 2.0), (0.9, 1.1)}


# Each name-valued key, the names it accepts (written out: the README and conf/ list them), the
# registry in workbench/algo/ they come from, and what a run with each name needs besides.
ACCEPTED = {
    "algo.advantage": (
        ["reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "on_policy_distill", "turn"],
        ADVANTAGES,
    ),
    "algo.policy_loss": (["ppo", "gspo", "cispo", "sft"], POLICY_LOSSES),
    "algo.aggregation": (["token_mean", "seq_mean", "constant"], AGGREGATIONS),
    "algo.kl_estimator": (["k1", "k2", "k3"], KL_ESTIMATORS),
}
NEEDS = {
    "on_policy_distill": ["algo.teacher_warm_start_steps=1"],
    "constant": ["algo.constant_denominator=64"],
}


@pytest.mark.parametrize("key", sorted(ACCEPTED))
def test_the_registries_hold_exactly_the_names_config_accepts(key):
    names, registry = ACCEPTED[key]
    assert list(registry) == names
    for name in names:
        cfg = compose_config([f"{key}={name}", *NEEDS.get(name, [])])
        assert cfg.algo[key.split(".")[1]] == name


@pytest.mark.parametrize(
    "override, sentence",
    [
        (
            "algo.advantage=ppo",
            "algo.advantage=ppo is unknown: use one of reinforce, reinforce_baseline, rloo, grpo, "
            "dr_grpo, on_policy_distill, turn.",
        ),
        ("algo.policy_loss=dpo", "algo.policy_loss=dpo is unknown: use ppo, gspo, cispo or sft."),
        (
            "algo.aggregation=sum",
            "algo.aggregation=sum is unknown: use one of token_mean, seq_mean, constant.",
        ),
        ("algo.kl_estimator=k4", "algo.kl_estimator=k4 is unknown: use k1, k2 or k3."),
        ("gate.denominator=some", "gate.denominator=some is unknown: use all or kept."),
    ],
)
def test_an_unknown_name_is_refused_with_its_sentence(override, sentence):
    with pytest.raises(ConfigError) as error:
        compose_config([override])
    assert str(error.value) == sentence


def test_routing_replay_with_partial_rollout_is_safe_on_the_torch_engine():
    # the torch engine captures every forward's routes as it runs and never preempts a sequence
    cfg = compose_config(
        ["model=tiny-moe", "algo.routing_replay=true", "rollout.partial=true", "gate.level=token"]
    )
    assert cfg.algo.routing_replay and cfg.rollout.partial and cfg.engine.name == "torch"
