"""vLLM engine on a mixture-of-experts policy: its log-probs match a learner forward before and
after a weight push (the CPU expert kernels are re-packed after each reload). On the CPU backend
vLLM cannot return routed experts (they need Model Runner V2), so there a generation carries none;
their decoding is tested on recorded outputs in tests/invariants/test_routing_replay.py. Own
module: one vLLM engine per process."""

import importlib.util

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from workbench.engines.base import SamplingParams
from workbench.engines.vllm_engine import VllmEngine
from workbench.models.tiny import tiny_model_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install 'molt-wb[vllm]'",
)


def test_moe_logprobs_match_the_learner_before_and_after_a_weight_push():
    path = str(tiny_model_path("tiny-moe"))
    engine = VllmEngine(path, check_weight_sync=True)
    learner = AutoModelForCausalLM.from_pretrained(path).eval()
    learner.set_experts_implementation("eager")
    prompts = [np.arange(3, 12, dtype=np.int32), np.arange(40, 45, dtype=np.int32)]
    generator = torch.Generator().manual_seed(0)
    for version in (0, 1):
        if version:
            state = {
                k: v + 0.05 * torch.randn(v.shape, generator=generator)
                for k, v in learner.state_dict().items()
            }
            learner.load_state_dict(state)
            engine.load_weights(state, version)
        out = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=3))
        for prompt, generation in zip(prompts, out, strict=True):
            assert set(generation.versions) == {version}
            # CPU: none
            assert "routed_experts" not in generation.extras
            sequence = np.concatenate([prompt, generation.token_ids])
            ids = torch.tensor(sequence, dtype=torch.long)[None]
            with torch.no_grad():
                dist = torch.log_softmax(
                    learner(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1
                )
            reference = dist.gather(
                -1, torch.tensor(generation.token_ids, dtype=torch.long)[:, None]
            ).squeeze(-1)
            np.testing.assert_allclose(
                generation.logprobs, reference.numpy(), atol=2e-4, err_msg=f"version {version}"
            )
