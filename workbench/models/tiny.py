"""Tiny policies built offline: a real HF tokenizer and a real transformers model, no download.

A byte-level BPE is trained in a fraction of a second on a built-in corpus (so any text encodes),
wrapped as a `PreTrainedTokenizerFast` with a ChatML template and the response template its replies
parse with, and paired with a randomly initialised Qwen3 causal LM small enough that an RL step on
2 CPU cores takes seconds. Both are saved as an ordinary HF checkpoint folder, cached on disk by a
hash of their spec, so every actor (and vLLM later) loads the same files by path.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# torch, tokenizers and transformers load inside the builders: config, the CLI and the TUI import
# this module for its names only.

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
# Qwen2-VL's; image_pad is expanded per image
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]

# ChatML with Qwen-style tools: a tool list in the system turn, calls as
# <tool_call>{json}</tool_call> after the assistant's text, tool results as <tool_response> user
# turns.
CHAT_TEMPLATE = (
    "{%- macro content(c) %}{%- if c is string %}{{- c }}{%- else %}{%- for part in c %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- set first_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if first_system %}{{- content(messages[0]['content']) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    '{{- \'</tools>\\nCall a tool as <tool_call>{\\"name\\": ..., \\"arguments\\": ...}'
    "</tool_call>.<|im_end|>\\n' }}"
    "{%- elif first_system %}"
    "{{- '<|im_start|>system\\n' + content(messages[0]['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>' }}"
    "{{- {'name': call['name'], 'arguments': call['arguments']} | tojson }}"
    "{{- '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + content(message['content'])"
    " + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content(message['content'])"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# How a reply in this format reads, for transformers' response parser (`parse_response`; the
# tokenizer config holds it): <think> reasoning, <tool_call>{json}</tool_call> calls, and the text
# around them, whole. The loopback server's default for a tokenizer whose config holds none.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open": "<think>", "close": "</think>"},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {
            "close": "<|im_end|>",
            "repeats": True,
            "join": "",
            "content_args": {"strip": False},
        },
    },
}

# Shapes of the built-in tiny models. head_dim 32 is the smallest vLLM's CPU attention accepts.
_SHAPE = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512
)
TINY_SPECS = {
    "tiny": dict(_SHAPE, family="qwen3", num_hidden_layers=2, intermediate_size=256),
    # a dense Qwen3 with ~10x tiny's compute per token (4.2M parameters): scaling benchmarks,
    # heavier CPU runs
    "small": dict(
        _SHAPE,
        family="qwen3",
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=4,
        intermediate_size=1024,
    ),
    # mixtures of experts: 8 experts, top-2, every one of 3 layers sparse
    "tiny-moe": dict(
        _SHAPE,
        family="qwen3_moe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=256,
        norm_topk_prob=True,
    ),
    "tiny-mixtral": dict(
        _SHAPE,
        family="mixtral",
        num_hidden_layers=3,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
    ),
    # vision-language: Qwen2-VL with a 2-block vision tower; a 112x112 image is 64 patches, 16
    # tokens after merging
    "tiny-vl": dict(
        _SHAPE,
        vocab_size=1024,
        family="qwen2_vl",
        num_hidden_layers=2,
        intermediate_size=256,
        image_pixels=112 * 112,
        vision=dict(
            depth=2,
            embed_dim=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
    ),
}

_CORPUS = """\
You are a helpful assistant. Answer the question. The answer is 42. What is 3 + 4? 7.
Solve step by step, then give the final answer. Compute the sum, the difference and the product.
user assistant system tool call result error true false none null def return print import for in
if else while the of and to a is that it with as on was for be by this are or from at which an
triangle circle angle line length area radius degrees parallel perpendicular find x y z answer
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) [ ] { } < > , . : ; ? ! ' "
\\boxed{} reverse copy string letters abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ
"""


def cache_root():
    """Where built models live: $MOLT_WB_CACHE, else ~/.cache/molt-wb (an empty value is unset:
    `Path("")` would be the working directory)."""
    return Path(os.environ.get("MOLT_WB_CACHE") or Path.home() / ".cache" / "molt-wb").absolute()


def spec_hash(spec):
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


# The vision-language model's tokenizer also learns the phrases of tool-using geometry episodes
# (a tool schema, a tool call, a diagram question), so a rendered episode is a few hundred tokens,
# not a thousand. A backslash at a line's end continues the line: the string has no break there.
_TOOL_CORPUS = """\
Solve the geometry problem shown in the diagram. You may run Python with the python_executor tool.
Give the final answer as <answer>...</answer>. # Tools <tools> </tools> <tool_response> \
</tool_response>
{"type": "function", "function": {"name": "python_executor", "description": "Run Python code \
in a sandbox and return what it prints.", "parameters": {"type": "object", "properties": \
{"code": {"type": "string"}}, "required": ["code"]}}}
Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>.
<tool_call>{"name": "python_executor", "arguments": {"code": "print(180 - 50 - 60)"}}</tool_call> \
<answer>70</answer>
Two angles of the triangle measure 50° and 60°. Find x, the third angle, in degrees.
The legs of the right triangle measure 3 and 4. Find x, the hypotenuse. \\sqrt{2} \\pi
The radius of the circle is 5. Find the area of the circle, in terms of \\pi. circumference
Two parallel lines are cut by a transversal. An angle measures 70°, and x is its corresponding \
angle.
alternate interior same-side interior Find x in degrees. The rectangle has sides 7 and 2. Find its \
perimeter.
"""


def build_tokenizer(vocab_size, vision=False):
    """A byte-level BPE with ChatML special tokens (and Qwen2-VL's vision tokens), chat template
    and response template (~0.1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special_tokens = SPECIAL_TOKENS
    corpus = _CORPUS
    if vision:
        special_tokens = SPECIAL_TOKENS + VISION_TOKENS
        corpus = _CORPUS + _TOOL_CORPUS
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus.splitlines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def build_model(spec, tokenizer):
    """A causal LM of the given spec, initialised at random from its `seed` (untied embeddings:
    vLLM reloads need it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = {
        k: v
        for k, v in spec.items()
        if k not in ("family", "seed", "template", "vision", "image_pixels")
    }
    fields.update(
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        max_position_embeddings=2048,
    )
    torch.manual_seed(spec["seed"])
    if "vision" not in spec:
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[spec["family"]](**fields))
    # Qwen2-VL derives head_dim; mrope sections (t, h, w) split its 16 rotary pairs
    fields.pop("head_dim")
    fields["rope_parameters"] = {
        "rope_type": "default",
        "mrope_section": [4, 6, 6],
        "rope_theta": 1e6,
    }
    start, end, pad = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = CONFIG_MAPPING[spec["family"]](
        text_config=fields,
        vision_config=dict(spec["vision"], hidden_size=fields["hidden_size"]),
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    return AutoModelForImageTextToText.from_config(config)


def is_moe(model_config):
    """Whether a transformers config describes a mixture-of-experts model."""
    return any(
        getattr(model_config, key, 0)
        for key in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def tiny_model_path(name="tiny"):
    """Build (once) and return the folder of the tiny model `name`; safe under concurrent
    callers."""
    if name not in TINY_SPECS:
        raise ValueError(
            f"Unknown tiny model {name!r}: use one of {sorted(TINY_SPECS)} or set model.path."
        )
    spec = dict(
        TINY_SPECS[name],
        seed=0,
        template=spec_hash(
            {
                "t": CHAT_TEMPLATE,
                "response": RESPONSE_TEMPLATE,
                "tools": "vision" in TINY_SPECS[name] and _TOOL_CORPUS,
            }
        ),
    )
    target = cache_root() / "models" / f"{name}-{spec_hash(spec)}"
    if (target / "config.json").exists():
        return target
    with one_builder(target):
        return _build_tiny(target, spec)


def _build_tiny(target: Path, spec: dict) -> Path:
    """Build the tiny model of `spec` into `target`, unless a builder before this one did."""
    if (target / "config.json").exists():
        return target
    tokenizer = build_tokenizer(spec["vocab_size"], vision="vision" in spec)
    model = build_model(spec, tokenizer)
    with built_into(target) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # images are resized to exactly image_pixels (no download: the processor is built here)
        if "vision" in spec:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil,
            )

            vision = spec["vision"]
            Qwen2VLImageProcessorPil(
                min_pixels=spec["image_pixels"],
                max_pixels=spec["image_pixels"],
                patch_size=vision["patch_size"],
                merge_size=vision["spatial_merge_size"],
                temporal_patch_size=vision["temporal_patch_size"],
            ).save_pretrained(staging)
    return target


@contextlib.contextmanager
def one_builder(target: Path):
    """Build `target` one process at a time: an advisory lock on a file beside it, held for the
    block. Runs, sweep jobs and test workers that need the same model at once wait for the first
    build and then find it, instead of each building it again (`built_into` keeps them correct
    either way; this keeps them from repeating minutes of work)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def built_into(target: Path):
    """A new hidden folder beside `target` to build a model in, renamed to `target` when the block
    ends: a half-built model is never visible. Safe under concurrent builders: when another one
    won the race, this one's folder is dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    yield staging
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
