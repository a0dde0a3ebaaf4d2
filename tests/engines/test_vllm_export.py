"""An exported checkpoint serves on vLLM (#15): the learner's checkpoint, written with
torch.distributed.checkpoint beside its policy folder, exported by `molt-wb export`, loads in the
vLLM engine, whose log-probs match transformers' forward of the same folder. Own module: one vLLM
engine per process (CI stage 2)."""

import importlib.util
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from workbench.algo.losses import token_logprobs
from workbench.cli import export
from workbench.config import compose_config
from workbench.engines.base import SamplingParams
from workbench.learner.learner import Learner
from workbench.models.tiny import tiny_model_path
from workbench.segment import Segment

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install 'molt-wb[vllm]'",
)


def test_an_exported_checkpoint_serves_on_vllm(tmp_path):
    from workbench.engines.vllm_engine import VllmEngine

    cfg = compose_config(["trainer.lr=1e-2"])
    OmegaConf.update(cfg, "run.id", "export")
    learner = Learner(cfg, str(tiny_model_path("tiny")))
    ids = np.arange(5, 25, dtype=np.int32)
    mask = (np.arange(20) >= 10).astype(np.uint8)
    versions = mask.astype(np.int32) - 1
    segments = [
        Segment("export", i, 0, 0, ids, mask, np.zeros(20, np.float32), versions, float(i))
        for i in range(2)
    ]
    learner.train(segments)
    checkpoint = tmp_path / "runs" / "export" / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    (tmp_path / "runs" / "export" / "run.json").write_text(json.dumps({"run_id": "export"}))
    learner.save_checkpoint(str(checkpoint), {"step": 0})
    out = tmp_path / "exported"
    export("export", [str(out)], root=str(tmp_path / "runs"), merged=False)
    engine = VllmEngine(str(out))
    prompt = np.arange(3, 12, dtype=np.int32)
    (generation,) = engine.generate([prompt], SamplingParams(max_tokens=8, seed=3))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    full = torch.from_numpy(np.r_[prompt, generation.token_ids].astype(np.int64))[None]
    with torch.no_grad():
        expected = token_logprobs(model(input_ids=full).logits, full)[0, len(prompt) :]
    torch.testing.assert_close(
        torch.from_numpy(generation.logprobs).float(), expected, atol=2e-4, rtol=1e-4
    )
