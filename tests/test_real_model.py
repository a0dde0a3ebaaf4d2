"""The workbench on a real pretrained model: SmolLM2-135M-Instruct (model=smollm2-135m), its
49,152-token BPE and its own chat template, which inserts a system prompt the task never sent.

One LoRA run of two steps (2 prompts x 2 samples, 8 new tokens) from the cached conversion: the
store holds the sampled ids with their log-probs and versions (recomputed here from the base
weights with transformers alone), identity violations 0, the adapter synced to the rollout worker
before the second step; then the inspector opens its token view, `export --merged` writes a folder
transformers loads, `serve` serves that folder to the OpenAI SDK, and `resume` continues the run
from its checkpoint. The model is converted once into the test model cache (MOLT_WB_CACHE; CI
builds it before the suite); skipped when neither the hub nor the registry is reachable and no
conversion is cached.
"""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.algo.losses import token_logprobs
from workbench.models import pretrained
from workbench.store import open_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_ray")]

RUN = [
    "+recipe=arith",
    "model=smollm2-135m",
    "model.lora.rank=8",
    "model.warm_start_steps=0",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "trainer.group_size=2",
    "trainer.checkpoint_every=1",
    "trainer.lr=1e-4",
    "engine.max_tokens=8",
    "tracking=none",
    "run.progress=false",
    "run.id=real",
]


def molt_wb(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def smollm() -> Path:
    """The converted SmolLM2-135M-Instruct folder: cached, or fetched and converted now."""
    held = pretrained.cached_path("smollm2-135m")
    if held:
        return held
    pytest.importorskip("gguf", reason="no SmolLM2 copy is cached and the gguf extra is absent")
    try:
        return pretrained.pretrained_path("smollm2-135m")
    except pretrained.Unreachable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def run(smollm: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The run root of the two-step LoRA run."""
    root = str(tmp_path_factory.mktemp("real-runs"))
    result = molt_wb("train", *RUN, f"run.root={root}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "0 violations" in result.stdout
    return root


def test_the_store_holds_the_sampled_ids_log_probs_and_versions(smollm: Path, run: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    db = open_run("real", run)
    violations = db.execute(
        "select sum(value) from metrics where key = 'identity/violations'"
    ).fetchone()[0]
    assert violations == 0
    # synchronous: every sampled token comes from the weights of its own step (the adapter of
    # step 1 reached the worker), and the learner scores it as the engine did
    steps, stale, gap = db.execute(
        "select count(distinct step), count(*) filter (where behavior_version <> step), "
        "max(abs(train_logprob - behavior_logprob)) from tokens where loss_mask = 1"
    ).fetchone()
    assert steps == 2 and stale == 0 and gap < 1e-3
    # step 0 sampled from the base weights: transformers alone gives the stored log-probs of the
    # stored ids at the run's temperature
    tokenizer = AutoTokenizer.from_pretrained(smollm)
    model = AutoModelForCausalLM.from_pretrained(smollm, dtype=torch.float32).eval()
    segments = db.execute(
        "select rollout_id, segment_idx, response_text from segments where step = 0"
    ).fetchall()
    assert len(segments) == 4
    for rollout, segment, response in segments:
        ids, mask, behavior = zip(
            *db.execute(
                "select token_id, loss_mask, behavior_logprob from tokens where step = 0 and "
                "rollout_id = ? and segment_idx = ? order by position",
                [rollout, segment],
            ).fetchall(),
            strict=True,
        )
        sampled = torch.tensor(mask).bool()
        with torch.no_grad():
            ids_tensor = torch.tensor([ids])
            again = token_logprobs(model(ids_tensor).logits, ids_tensor, 1.0)[0]
        torch.testing.assert_close(
            again[sampled], torch.tensor(behavior)[sampled], atol=2e-4, rtol=0
        )
        # the real template: its default system prompt, then the task's user turn
        text = tokenizer.decode(ids)
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert response in text


def test_the_summary_names_the_runs_peak_memory(run: str) -> None:
    result = molt_wb("runs", "real", "--root", run)
    assert result.returncode == 0 and "memory     peak PSS" in result.stdout


def test_the_inspector_opens_a_token_view_in_the_real_vocabulary(run: str) -> None:
    pytest.importorskip("textual")
    from workbench.tui.app import InspectApp
    from workbench.tui.token_screen import TokenScreen

    async def script(pilot) -> tuple:
        await pilot.press("2", "enter")
        screen = pilot.app.screen
        return screen, screen.text.plain

    async def main() -> tuple:
        app = InspectApp(run, "real")
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            return await script(pilot)

    screen, text = asyncio.run(main())
    assert isinstance(screen, TokenScreen)
    # the pieces are the real tokenizer's: its template's words, not ids
    assert "SmolLM" in text and "<|im_start|>" in text


def test_export_merged_loads_in_transformers_and_serve_serves_it(run: str, tmp_path: Path) -> None:
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    result = molt_wb("export", "real", "2", str(out), "--merged", "--root", run)
    assert result.returncode == 0, result.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert not (out / "adapter_config.json").exists()
    served = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            "--json",
            "model=hf",
            f"model.path={out}",
            "engine.max_tokens=8",
            f"run.root={tmp_path}",
            "run.id=served",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        info = json.loads(served.stdout.readline())
        client = openai.OpenAI(
            base_url=info["openai_base_url"], api_key=info["api_key"], max_retries=0
        )
        reply = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "What is 2 + 3?"}]
        )
        assert reply.choices[0].message.content is not None
        served.send_signal(signal.SIGTERM)
        assert served.wait(timeout=120) == 0
    finally:
        served.kill()
    db = open_run("served", str(tmp_path))
    assert db.execute("select count(*) from segments").fetchone()[0] == 1


def test_resume_continues_the_run_from_its_checkpoint(run: str) -> None:
    result = molt_wb("resume", "real", "trainer.steps=3", "--root", run)
    assert result.returncode == 0, result.stderr[-3000:]
    db = open_run("real", run)
    assert db.execute("select status, steps_done from runs").fetchone() == ("finished", 3)
    versions = db.execute(
        "select step, min(behavior_version), max(behavior_version) from tokens "
        "where loss_mask = 1 group by step order by step"
    ).fetchall()
    assert versions == [(0, 0, 0), (1, 1, 1), (2, 2, 2)]
