"""The vLLM engine serves a LoRA policy (#16): each pushed adapter version is a LoRARequest on the
base, and the tokens it samples carry that version and the log-probs the learner recomputes under
the same adapter. Own module: one vLLM engine per process (CI stage 2)."""

import importlib.util

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from workbench.algo.losses import token_logprobs
from workbench.config import compose_config
from workbench.engines.base import SamplingParams, from_wire
from workbench.learner.learner import Learner
from workbench.models.tiny import tiny_model_path
from workbench.segment import Segment

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install 'molt-wb[vllm]'",
)


def test_pushed_adapter_versions_sample_what_the_learner_scores():
    from workbench.engines.vllm_engine import VllmEngine

    # behavior log-probs of 0 here: the gate off, so the step is not masked away
    cfg = compose_config(["model.lora.rank=8", "trainer.lr=5e-2", "gate.level=off"])
    OmegaConf.update(cfg, "run.id", "lora")
    path = str(tiny_model_path("tiny"))
    learner = Learner(cfg, path)
    engine = VllmEngine(path, gpu_memory_utilization=0.1, lora=cfg.model.lora)
    prompt = np.arange(3, 12, dtype=np.int32)
    params = SamplingParams(max_tokens=8, seed=3)
    for version in (0, 1):
        if version:
            mask = (np.arange(20) >= 10).astype(np.uint8)
            versions = mask.astype(np.int32) - 1
            # two different replies, one rewarded
            rows = [
                Segment(
                    "lora",
                    i,
                    0,
                    0,
                    np.arange(5, 25, dtype=np.int32) + 7 * i,
                    mask,
                    np.zeros(20, np.float32),
                    versions,
                    float(i),
                )
                for i in range(2)
            ]
            learner.train(rows)
            weights = learner.weights()
            engine.load_weights(from_wire(weights["state_dict"]), weights["version"])
        (generation,) = engine.generate([prompt], params)
        assert set(generation.versions) == {learner.version}
        full = torch.from_numpy(np.r_[prompt, generation.token_ids].astype(np.int64))[None]
        with torch.no_grad():
            expected = token_logprobs(learner.model(input_ids=full).logits, full)[0, len(prompt) :]
        torch.testing.assert_close(
            torch.from_numpy(generation.logprobs).float(), expected, atol=2e-4, rtol=1e-4
        )
    # the adapter changed the policy: the check is not between two equal models
    with torch.no_grad(), learner.model.disable_adapter():
        base = token_logprobs(learner.model(input_ids=full).logits, full)[0, len(prompt) :]
    assert (base - expected).abs().max() > 1e-3
