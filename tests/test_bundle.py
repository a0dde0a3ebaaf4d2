"""Replay bundles: `molt-wb bundle RUN STEP` writes one step of a real run to one file and
`molt-wb replay FILE` re-runs it on the CPU, every output of the learner diffed against the
recorded one; a changed weight is caught, a step without its weights refused in one sentence."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from safetensors.numpy import load, save
from typer.testing import CliRunner

from workbench.cli import app

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

RUN = [
    "+recipe=arith",
    # a MoE policy one version behind: routes and stale tokens in every bundle
    "model=tiny-moe",
    "trainer.async_depth=1",
    "gate.level=token",
    "trainer.steps=3",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
    # an entropy bonus: a loss and a gradient even when every reward is 0
    "algo.entropy_coef=0.01",
    "trainer.checkpoint_every=1",
    "trainer.keep_checkpoints=2",
    "run.id=bundled",
]


def molt_wb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, timeout=600
    )


def in_process(*args: str) -> subprocess.CompletedProcess:
    """A bundle or replay command run in this process (its imports paid once)."""
    result = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def perturbed(bundle: Path, out: Path, member: str, change) -> Path:
    """A copy of `bundle` whose safetensors `member` holds `change(tensors)` instead."""
    with zipfile.ZipFile(bundle) as source, zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == member:
                data = save(change(load(data)))
            target.writestr(item, data)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    result = molt_wb("train", *RUN, f"run.root={root}")
    assert result.returncode == 0, result.stderr[-2000:]
    return root


@pytest.mark.slow
def test_a_bundle_of_a_checkpointed_step_replays_every_output_exactly(root: Path) -> None:
    # step 2 trained on version 2, which checkpoints/step-000002 holds
    out = root / "step2.zip"
    written = in_process("bundle", "bundled", "2", "--root", str(root), "--out", str(out))
    assert written.returncode == 0, written.stderr
    assert "16 of 16 rows, weights version 2" in written.stdout
    # small enough to attach to an issue: the policy's safetensors, no optimizer state
    assert out.stat().st_size < 4 * 2**20
    assert not any(name.endswith((".pt", ".distcp")) for name in zipfile.ZipFile(out).namelist())
    replayed = in_process("replay", str(out), "--atol", "0", "--rtol", "0")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    outputs = ("pi_old", "is_weight", "gate decision", "routing mismatched", "loss/grad_norm")
    for output in outputs:
        assert output in replayed.stdout
    assert "every output replays within the tolerance" in replayed.stdout


@pytest.mark.slow
def test_a_perturbed_weight_is_caught_and_exits_non_zero(root: Path) -> None:
    # step 0 trained on the starting policy, embedded as weights/policy/
    out = root / "step0.zip"
    assert (
        in_process("bundle", "bundled", "0", "--root", str(root), "--out", str(out)).returncode == 0
    )
    # the final norm's scale: every token's logits move by about 1 %
    changed = perturbed(
        out,
        root / "perturbed.zip",
        "weights/policy/model.safetensors",
        lambda tensors: tensors | {"model.norm.weight": tensors["model.norm.weight"] + 0.01},
    )
    assert in_process("replay", str(out)).returncode == 0
    replayed = in_process("replay", str(changed))
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "DIFFERS" in replayed.stdout
    assert "outputs differ beyond the tolerance (pi_old (train_logprob)" in replayed.stdout


@pytest.mark.slow
def test_a_bundle_of_some_rows_compares_what_depends_on_a_row_alone(root: Path) -> None:
    out = root / "rows.zip"
    written = in_process(
        "bundle", "bundled", "2", "--rows", "4", "--root", str(root), "--out", str(out)
    )
    assert "4 of 16 rows" in written.stdout
    replayed = in_process("replay", str(out))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "not compared: 4 of 16 rows, these need all" in replayed.stdout


@pytest.mark.slow
def test_a_step_whose_weights_no_checkpoint_keeps_is_refused_naming_the_fix(root: Path) -> None:
    # keep_checkpoints=2 kept versions 2 and 3: step 1's version 1 is gone
    refused = in_process("bundle", "bundled", "1", "--root", str(root))
    assert refused.returncode == 2
    assert "bundleable steps: 0, 2" in refused.stderr
    assert "trainer.checkpoint_every=1" in refused.stderr
    missing = in_process("bundle", "bundled", "9", "--root", str(root))
    assert "has no step 9 in its store (steps 0 to 2)" in missing.stderr


def test_a_file_that_is_no_bundle_is_refused_in_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a bundle")
    result = in_process("replay", str(path))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {path} is not a molt-wb bundle: write one with `molt-wb bundle`."
    )


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run one version behind, with a KL term: its reference is the base, adapter off."""
    root = tmp_path_factory.mktemp("lora-runs")
    dense = [a for a in RUN if not a.startswith(("model=", "run.id="))]
    lora = ["model.lora.rank=4", "trainer.lr=1e-2", "algo.kl_coef=0.1", "run.id=lora-bundled"]
    result = molt_wb("train", *dense, *lora, f"run.root={root}")
    assert result.returncode == 0, result.stderr[-2000:]
    return root


@pytest.mark.slow
def test_a_lora_step_bundles_its_adapter_and_names_its_base_and_replays_exactly(
    lora_root: Path,
) -> None:
    out = lora_root / "lora-step2.zip"
    written = in_process("bundle", "lora-bundled", "2", "--root", str(lora_root), "--out", str(out))
    assert written.returncode == 0, written.stderr
    assert "weights version 2 (base embedded; policy embedded)" in written.stdout
    names = zipfile.ZipFile(out).namelist()
    # the adapter alone (a checkpoint's policy/ of a LoRA run), beside the base it goes on
    assert "weights/policy/adapter_model.safetensors" in names
    assert "weights/base/model.safetensors" in names
    replayed = in_process("replay", str(out), "--atol", "0", "--rtol", "0")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "loss/kl" in replayed.stdout
    # a changed adapter is caught
    changed = perturbed(
        out,
        lora_root / "lora-perturbed.zip",
        "weights/policy/adapter_model.safetensors",
        lambda tensors: {k: v + 0.05 if "lora_B" in k else v for k, v in tensors.items()},
    )
    replayed = in_process("replay", str(changed))
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "outputs differ beyond the tolerance (pi_old (train_logprob)" in replayed.stdout
    # version 0 is the base with the fresh adapter every process builds alike: nothing to carry
    first = lora_root / "lora-step0.zip"
    written = in_process(
        "bundle", "lora-bundled", "0", "--root", str(lora_root), "--out", str(first)
    )
    assert "weights version 0 (base embedded)" in written.stdout
    replayed = in_process("replay", str(first), "--atol", "0", "--rtol", "0")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
