"""reasoning-gym's tasks as Envs (plugins/reasoning_gym.py), on the real package: the reward is
reasoning-gym's full score only, agent.env_kwargs reach the episodes, the training data and the
held-out split, the two splits never share a seed, and episodes run through a rollout worker."""

import pytest
from omegaconf import OmegaConf

from workbench.api import Env, load_plugin
from workbench.config import ConfigError, compose_config, validate
from workbench.rollout.worker import RolloutWorker
from workbench.run.data import Prompts
from workbench.run.evaluate import eval_samples

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

pytest.importorskip("reasoning_gym")

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def episode(spec: str, sample: dict, reply: str, env_kwargs: dict | None = None) -> float:
    """The reward of one episode of `spec` on `sample` that replies `reply`."""
    env = load_plugin(spec, env_kwargs).AgentRunner()
    env.reset(sample)
    return env.step(reply).reward


@pytest.mark.parametrize(
    ("template", "reward"),
    [
        ("{answer}", 1.0),
        ("The answer is {answer}.", 1.0),
        ("<answer>{answer}</answer> (not 1234)", 1.0),
        ("{answer} or maybe 1234", 0.0),
        ("{answer}, no: 1234", 0.0),
        ("", 0.0),
    ],
)
def test_chain_sum_rewards_the_last_number_at_full_credit_only(
    template: str, reward: float
) -> None:
    sample = load_plugin("reasoning_gym:chain_sum", CHAIN_SUM).make_dataset(1, 0)[0]
    reply = template.format(answer=sample["answer"])
    assert episode("reasoning_gym:chain_sum", sample, reply, CHAIN_SUM) == reward


def test_a_text_task_gets_no_partial_credit_for_containing_the_answer() -> None:
    plugin = load_plugin("reasoning_gym:base_conversion")
    # an answer with letters in it (a base above 10): the reply's last line is its answer
    sample = next(s for s in plugin.make_dataset(32, 0) if not s["answer"].isdigit())
    env = plugin.AgentRunner()
    env.reset(sample)
    contained = env.step(f"In the new base it reads {sample['answer']} indeed")
    # reasoning-gym itself would give the answer's share of the reply's length
    assert 0 < contained.info["score"] < 1
    assert contained.reward == 0.0
    assert env.step(sample["answer"]).reward == 1.0


def test_the_task_class_is_an_env_bound_to_its_task() -> None:
    plugin = load_plugin("reasoning_gym:gcd")
    assert issubclass(plugin.AgentRunner, Env)
    sample = plugin.make_dataset(1, 5)[0]
    assert "GCD" in plugin.AgentRunner().reset(sample)
    assert sample["problem"].endswith("Answer with just the number.")


def test_env_kwargs_reach_the_training_data_and_the_held_out_split() -> None:
    three_terms = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}
    cfg = compose_config(["tracking=none", "agent.plugin=reasoning_gym:chain_sum"])
    OmegaConf.update(cfg, "agent.env_kwargs", three_terms, force_add=True)
    validate(cfg)
    train = Prompts(cfg).samples
    _, held_out = eval_samples(cfg)
    for sample in train + held_out:
        assert sample["metadata"]["num_terms"] == 3
        assert sample["metadata"]["num_digits"] == 1


def test_the_held_out_split_shares_no_seed_and_no_question_with_training() -> None:
    plugin = load_plugin("reasoning_gym:chain_sum")
    train = plugin.make_dataset(512, 0)
    held_out = plugin.eval_dataset(64, 0)
    # reasoning-gym draws item i from Random(seed + i): the held-out seeds start past training's
    assert held_out == plugin.make_dataset(64, plugin.EVAL_OFFSET)
    assert not {s["problem"] for s in train} & {s["problem"] for s in held_out}


def test_a_key_the_task_does_not_take_is_refused_with_one_sentence() -> None:
    cfg = compose_config(
        ["tracking=none", "agent.plugin=reasoning_gym:gcd", "+agent.env_kwargs.x=1"]
    )
    with pytest.raises(
        ConfigError, match=r"reasoning-gym's gcd refused agent.env_kwargs \{'x': 1\}"
    ):
        Prompts(cfg)


def test_a_task_reasoning_gym_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="has no no_such_task"):
        load_plugin("reasoning_gym:no_such_task")


def test_keys_a_plugin_does_not_take_are_refused_at_start_up() -> None:
    with pytest.raises(ConfigError, match="its ArithEnv does not take agent.env_kwargs"):
        validate(compose_config(["tracking=none", "+agent.env_kwargs.max_terms=2"]))


def test_episodes_run_through_a_rollout_worker(tiny_path: str) -> None:
    cfg = compose_config(
        [
            "tracking=none",
            "agent.plugin=reasoning_gym:chain_sum",
            "trainer.prompts_per_step=2",
            "trainer.group_size=2",
            "engine.max_tokens=4",
        ]
    )
    OmegaConf.update(cfg, "agent.env_kwargs", CHAIN_SUM, force_add=True)
    OmegaConf.update(cfg, "run.id", "reasoning-gym")
    prompts = Prompts(cfg)
    segments = RolloutWorker(cfg, tiny_path).rollout(prompts.next_jobs(1)[0])
    assert len(segments) == 4
    for segment in segments:
        assert segment.reward in (0.0, 1.0)
        assert segment.audit["identity"]


@pytest.mark.slow
def test_the_smol_gcd_recipe_trains_the_real_model_with_identity_intact(tmp_path) -> None:
    import subprocess
    import sys

    from workbench.models import pretrained

    # the conversion, once per model cache (tests/test_real_model.py makes the same)
    if not pretrained.cached_path("smollm2-135m"):
        pytest.importorskip("gguf", reason="no SmolLM2 copy is cached and the gguf extra is absent")
        try:
            pretrained.pretrained_path("smollm2-135m")
        except pretrained.Unreachable as error:
            pytest.skip(str(error))
    root = str(tmp_path)
    train = [sys.executable, "-m", "workbench.cli", "train", "+recipe=smol_gcd", "run.id=smol"]
    train += ["trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=2"]
    train += ["engine.max_tokens=8", "tracking=none", "run.progress=false", f"run.root={root}"]
    result = subprocess.run(train, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "0 violations" in result.stdout
    scored = [sys.executable, "-m", "workbench.cli", "eval", "smol", "--root", root]
    scored += ["eval.size=2", "eval.temperature=0"]
    result = subprocess.run(scored, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval eval_dataset step 1: n=2" in result.stdout
