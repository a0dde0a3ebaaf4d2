"""Every recipe runs end to end on the tiny model: 2 steps each in one shared Ray, rewards recorded.

Tiny models cannot solve these tasks; what is checked is the whole path (plugin, engine, loopback
server, sandbox, judge, learner, store) and the recipe-specific records.
"""

import json

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from workbench.api import load_plugin
from workbench.cli import app
from workbench.config import compose_config
from workbench.run import loop
from workbench.run.cluster import init_ray
from workbench.store import open_run

TINY = [
    "tracking=none",
    "run.progress=false",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "trainer.group_size=2",
    "model.warm_start_steps=0",
    "engine.max_tokens=8",
]


@pytest.fixture(scope="module")
def ray_session():
    import ray

    init_ray(compose_config(["ray.num_cpus=2"]))
    yield
    ray.shutdown()


def test_code_reward_is_the_fraction_of_tests_the_sandbox_passes():
    code = load_plugin("code")
    sample = code.make_dataset(1, 0)[0]  # f(x) = x + k, three tests
    assert code.tests_passed(sample["solution"], sample["tests"]) == 3
    # only f(-k) == 0 holds
    assert code.tests_passed("def f(x):\n    return 0", sample["tests"]) == 1
    assert code.tests_passed("print('x', 3)\nsyntax error here", sample["tests"]) == 0
    env = code.AgentRunner()
    env.reset(sample)
    assert env.step(f"```python\n{sample['solution']}\n```").reward == 1.0


def test_math_grades_boxed_answers_by_numeric_equivalence():
    env = load_plugin("math").AgentRunner()
    env.reset({"problem": "What is 1/4 + 2/4?", "answer": "3/4"})
    assert (
        env.step("so \\boxed{0.75}").reward == 1.0
        and env.step("\\boxed{\\frac{3}{4}}").reward == 1.0
    )
    assert env.step("\\boxed{0.5}").reward == 0.0 and env.step("3/4 without a box").reward == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("math", ["eval.every=1", "eval.size=2", "eval.samples=2", "trainer.checkpoint_every=2"]),
        ("tool_use", []),
        ("code", []),
        ("judge", []),
        ("distill", []),
        ("guess_the_number", []),
        ("gem_guess_the_number", []),
    ],
)
def test_recipe_runs_end_to_end(ray_session, tmp_path, recipe, extra):
    cfg = compose_config([f"+recipe={recipe}", *TINY, f"run.root={tmp_path}", *extra])
    OmegaConf.update(cfg, "run.id", recipe)
    loop.train(cfg)
    db = open_run(recipe, str(tmp_path))
    steps, segments, rewards = db.execute(
        "select count(distinct step), count(*), count(reward) from segments"
    ).fetchone()
    assert steps == 2 and segments >= 8 and rewards == segments
    infos = [json.loads(info) for (info,) in db.execute("select info from segments").fetchall()]
    # the judge's prompt and verdict beside each segment, its score the reward
    if recipe == "judge":
        assert all("Reference answer" in i["judge_prompt"] and "verdict" in i for i in infos)
        unscored = db.execute(
            "select count(*) from segments "
            "where reward <> cast(json_extract(info, '$.score') as double)"
        ).fetchone()[0]
        assert unscored == 0
    if recipe == "code":
        assert all(i["tests"] == 3 for i in infos)
    if recipe == "distill":
        assert (
            db.execute("select count(*) from metrics where key = 'distill/kl'").fetchone()[0] == 2
        )
    if recipe == "math":
        assert db.execute("select count(*), min(n) from eval").fetchone() == (2, 4)
        assert (
            db.execute("select count(*) from metrics where key = 'eval/reward'").fetchone()[0] == 2
        )
        # molt-wb eval: a step number must name a saved checkpoint; by default the latest one is
        # scored
        missing = CliRunner().invoke(app, ["eval", "math", "7", "--root", str(tmp_path)])
        assert (
            missing.exit_code == 2 and "no checkpoint at step 7 (saved steps: 2)" in missing.output
        ), missing.output
        result = CliRunner().invoke(
            app, ["eval", "math", "--root", str(tmp_path), "eval.samples=3"]
        )
        assert result.exit_code == 0 and "n=6" in result.output, result.output
        # version 2 = the weights after loop step 1, where the in-training eval of step 1 also
        # scored
        assert db.execute(
            "select step, n from eval where checkpoint like '%step-000002%'"
        ).fetchall() == [(1, 6)]
