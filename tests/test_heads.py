"""The output layer in chunks of tokens (workbench/models/heads.py) gives the full logits' numbers:
log-probs, entropies and gradients equal a forward that keeps every logit, for the padded, packed
and shared-prefix forwards, at any temperature, with and without the entropy's graph; the
backward keeps no [tokens, vocab] tensor; the engine's prefill computes logits for one position."""

import numpy as np
import pytest
import torch

from workbench.algo.losses import token_logprobs_entropy
from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.models import heads
from workbench.models.heads import forward_logprobs_entropy, output_layer
from workbench.models.multimodal import load_policy
from workbench.models.packing import packed_logprobs
from workbench.models.prefix import plan, shared_prefix_logprobs

VOCAB = 512


def _llama(tied: bool, **extra) -> torch.nn.Module:
    """A random llama of SmolLM2's kind (tied input and output embeddings, grouped queries)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        **extra,
    )
    return LlamaForCausalLM(config).train()


@pytest.fixture(scope="module", params=["tiny-qwen3", "llama-tied"])
def model(request: pytest.FixtureRequest, tiny_path: str) -> torch.nn.Module:
    if request.param == "llama-tied":
        return _llama(tied=True)
    torch.manual_seed(0)
    return load_policy(tiny_path).train()


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 tokens: a batch runs through many chunks, the last one short."""
    monkeypatch.setattr(heads, "CHUNK_ELEMENTS", 3 * VOCAB)
    # the test models' small vocabularies in chunks too
    monkeypatch.setattr(heads, "WHOLE_VOCAB", 0)


def batch(groups: int = 3, size: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows: per group one prompt, per row its own reply of its own length."""
    rng = np.random.default_rng(2)
    rows, group_ids = [], []
    for g in range(groups):
        prompt = rng.integers(10, VOCAB, size=int(rng.integers(5, 9)))
        for _ in range(size):
            reply = rng.integers(10, VOCAB, size=int(rng.integers(1, 6)))
            rows.append(np.concatenate([prompt, reply]))
            group_ids.append(g)
    longest = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.from_numpy(r)
        mask[i, : len(r)] = 1
    return ids, mask, torch.tensor(group_ids)


def _inputs(ids: torch.Tensor, mask: torch.Tensor) -> dict:
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))


def _gradients(model: torch.nn.Module, logprob, entropies, mask) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of a weighted sum of the log-probs (and entropies) at real
    tokens."""
    model.zero_grad()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(7))
    loss = (logprob * weights * mask).sum()
    if entropies is not None and entropies.requires_grad:
        loss = loss + (entropies * weights.flip(0) * mask).sum()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: tuple, expected: tuple, mask: torch.Tensor) -> None:
    real = mask.bool()
    for mine, reference in zip(got, expected, strict=True):
        if reference is None:
            assert mine is None
            continue
        torch.testing.assert_close(mine[real], reference[real], atol=1e-5, rtol=1e-5)


def _assert_same_gradients(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("temperature", "entropy", "entropy_grad"),
    [(1.0, False, True), (0.7, True, True), (1.3, True, False)],
)
def test_chunked_logprobs_entropies_and_gradients_equal_the_full_logits(
    model, small_chunks, temperature: float, entropy: bool, entropy_grad: bool
) -> None:
    ids, mask, _ = batch()
    options = (temperature, entropy, entropy_grad)
    full = token_logprobs_entropy(model(**_inputs(ids, mask)).logits, ids, *options)
    expected = _gradients(model, *full, mask)
    chunked = forward_logprobs_entropy(model, _inputs(ids, mask), ids, *options)
    _assert_same(chunked, full, mask)
    assert chunked[1] is None or chunked[1].requires_grad == entropy_grad
    _assert_same_gradients(_gradients(model, *chunked, mask), expected)


@pytest.mark.parametrize("packed", [True, False])
def test_shared_prefix_and_packed_forwards_in_chunks_equal_the_full_logits(
    model, small_chunks, packed: bool
) -> None:
    ids, mask, groups = batch()
    options = (0.7, True, True)
    full = token_logprobs_entropy(model(**_inputs(ids, mask)).logits, ids, *options)
    expected = _gradients(model, *full, mask)
    split = plan(ids, mask.sum(-1), groups)
    assert split is not None
    shared = shared_prefix_logprobs(model, ids, mask, split, 0.7, packed, True, True)
    _assert_same(shared, full, mask)
    _assert_same_gradients(_gradients(model, *shared, mask), expected)
    rows = packed_logprobs(model, ids, mask, 0.7, None, True, True)
    _assert_same(rows, full, mask)
    _assert_same_gradients(_gradients(model, *rows, mask), expected)


def test_the_backward_keeps_no_tokens_by_vocabulary_tensor(model, small_chunks) -> None:
    ids, mask, _ = batch()
    kept = []
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # the weights (the output layer's [hidden, vocab] among them) are no activations
        if tensor.untyped_storage().data_ptr() not in weights:
            kept.append(tuple(tensor.shape))
        return tensor

    def widest(forward) -> int:
        """The most elements of a saved tensor a vocabulary wide, in `forward()`'s graph."""
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            forward()
        return max((np.prod(shape) for shape in kept if shape[-1:] == (VOCAB,)), default=0)

    def full() -> None:
        token_logprobs_entropy(model(**_inputs(ids, mask)).logits, ids, 1.0, True)

    def chunked() -> None:
        forward_logprobs_entropy(model, _inputs(ids, mask), ids, 1.0, True)

    # the full logits keep the batch's [rows, tokens, vocab]; the chunks at most one chunk's
    assert widest(full) >= len(ids) * (ids.shape[1] - 1) * VOCAB
    assert widest(chunked) <= 3 * VOCAB


def test_a_model_that_transforms_its_logits_keeps_them_whole_with_the_same_numbers(
    small_chunks,
) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=30.0,
    )
    gemma = Gemma2ForCausalLM(config)
    assert output_layer(gemma) is None and output_layer(_llama(tied=False)) is not None
    ids, mask, _ = batch()
    full = token_logprobs_entropy(gemma(**_inputs(ids, mask)).logits, ids, 1.0, True)
    _assert_same(forward_logprobs_entropy(gemma, _inputs(ids, mask), ids, 1.0, True), full, mask)


def test_the_engine_prefill_computes_logits_for_the_last_position_only(tiny_path: str) -> None:
    engine = TorchEngine(tiny_path)
    positions = []
    layer = engine.model.get_output_embeddings()
    hook = layer.register_forward_hook(lambda module, args, out: positions.append(out.shape[1]))
    prompts = [np.arange(10, 40, dtype=np.int32), np.arange(50, 62, dtype=np.int32)]
    try:
        engine.generate(prompts, SamplingParams(max_tokens=4, seed=0))
    finally:
        hook.remove()
    assert positions and set(positions) == {1}
