"""The built-in policies other tests do not build: `small`, the scaling benchmarks' dense policy."""

import torch
from transformers import AutoModelForCausalLM

from workbench.models.tiny import tiny_model_path


def test_small_is_a_dense_qwen3_with_about_ten_times_tiny_parameters_and_the_same_tokenizer(
    tiny_path,
):
    tiny = AutoModelForCausalLM.from_pretrained(tiny_path)
    small = AutoModelForCausalLM.from_pretrained(tiny_model_path("small"))
    ratio = sum(p.numel() for p in small.parameters()) / sum(p.numel() for p in tiny.parameters())
    assert small.config.model_type == "qwen3" and 8 < ratio < 12, ratio
    assert small.config.vocab_size == tiny.config.vocab_size
    ids = torch.tensor([[1, 2, 3, 4]])
    logits = small(input_ids=ids).logits
    assert logits.shape == (1, 4, small.config.vocab_size) and torch.isfinite(logits).all()
