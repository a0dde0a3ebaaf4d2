"""The policy's output layer in chunks of tokens: log-probs and entropies without a [tokens,
vocabulary] float32 tensor for the whole batch.

A forward's logits are the one tensor that grows with the vocabulary: 49,152 float32 columns are
192 KB a token, 200 MB for a batch of a thousand tokens, and autograd keeps them (and the softmax
of the entropy) until the backward. `deferred` runs the model with its output layer held back: a
pre-hook on `get_output_embeddings()` keeps the hidden states that layer reads and hands it none,
so the model returns empty logits. `slot_logprobs` then applies the layer to a chunk of hidden
states at a time, each chunk under `torch.utils.checkpoint`, so the backward recomputes one chunk's
logits at a time instead of keeping them all. The values are those of the full logits: the same
layer on the same rows, the same log-softmax and entropy (algo/losses.py), to float rounding.

Where the output layer is not the whole story the logits are kept whole (the head is then the
identity): a model that scales or soft-caps its logits after the layer (Gemma, Cohere, Granite),
and a policy sharded with FSDP2, whose root parameters are gathered only inside its own forward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from workbench.algo.losses import logits_entropy

# float32 logits per chunk: 2**24 (64 MB) is 341 tokens of a 49,152-token vocabulary, one chunk
# of 32,768 tokens of the tiny models' 512
CHUNK_ELEMENTS = 2**24
# a vocabulary this small keeps its logits whole (a token's logits are no larger than the
# activations the backward keeps of it anyway), and the tiny models train exactly as they did
WHOLE_VOCAB = 8192
# config keys of a transform applied to the logits after the output layer
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The layer that turns hidden states into logits, where applying it later in chunks gives
    the model's logits; None where the logits must be kept whole (or are small: WHOLE_VOCAB)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return None
    config = model.config.get_text_config()
    if any(getattr(config, key, None) not in (None, 1.0) for key in LOGIT_TRANSFORMS):
        return None
    layer = model.get_output_embeddings()
    if getattr(layer, "out_features", WHOLE_VOCAB + 1) <= WHOLE_VOCAB:
        return None
    return layer


@contextlib.contextmanager
def deferred(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block the model's forwards return empty logits; the yielded list receives, per
    forward, the hidden states [batch, seq, hidden] its output layer would have read. A model whose
    logits must stay whole (`output_layer` None) returns them as usual, and the list receives the
    logits themselves (apply `head(model)`, the identity, to them)."""
    layer = output_layer(model)
    captured = []
    if layer is None:
        hook = model.register_forward_hook(lambda module, args, out: captured.append(out.logits))
    else:

        def keep(module: torch.nn.Module, args: tuple) -> tuple:
            captured.append(args[0])
            # no position to apply the layer to: logits [batch, 0, vocab]
            return (args[0][:, :0], *args[1:])

        hook = layer.register_forward_pre_hook(keep)
    try:
        yield captured
    finally:
        hook.remove()


def head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What turns `deferred`'s captured tensors into logits: the output layer, or the identity
    where the logits were kept whole."""
    layer = output_layer(model)
    return layer if layer is not None else (lambda logits: logits)


def forward_logprobs_entropy(
    model: torch.nn.Module,
    inputs: dict,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs_entropy(model(**inputs).logits, token_ids, ...)` (algo/losses.py): the
    log-probs [batch, seq] of `token_ids` (column 0 holds 0) and with `entropy` their
    distributions' entropies [batch, seq], the output layer applied a chunk of tokens at a time."""
    with deferred(model) as captured:
        model(**inputs)
    hidden = captured[-1][:, :-1]  # [batch, seq - 1, hidden]: each predicts the next id
    rows, steps = hidden.shape[:2]
    source = torch.arange(rows * steps, device=hidden.device).view(rows, steps)
    options = (temperature, entropy, entropy_grad)
    return row_logprobs(model, hidden.flatten(0, 1), source, token_ids, *options)


def row_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    source: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [batch, seq] of each row's own ids (column 0 holds 0), token t predicted by the
    hidden state `hidden[source[row, t - 1]]` ([slots, hidden], captured by `deferred`; `source`
    [batch, seq - 1]), and with `entropy` the entropies [batch, seq] of those distributions: the
    layout of `token_logprobs_entropy`."""
    picked, entropies = slot_logprobs(
        head(model),
        hidden,
        source.flatten(),
        token_ids[:, 1:].flatten(),
        temperature,
        entropy,
        entropy_grad,
    )
    first = picked.new_zeros(len(source), 1)
    logprob = torch.cat([first, picked.view(source.shape)], dim=1)
    if entropies is None:
        return logprob, None
    return logprob, torch.cat([first, entropies[source]], dim=1)


def slot_logprobs(
    layer: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    source: torch.Tensor,
    target: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For hidden states [slots, hidden] and queries (`source` slot, `target` id) [queries]: the
    log-prob [queries] of each target under softmax(layer(hidden[source]) / temperature), and with
    `entropy` each slot's entropy [slots] (without a graph unless `entropy_grad`). A slot may
    answer several queries (a shared prefix's last position predicts each row's first own id)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    slots = hidden.shape[0]
    vocab = _vocab_size(layer, hidden)
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    order = torch.argsort(source, stable=True)
    edges = torch.searchsorted(
        source[order], torch.arange(0, slots + chunk, chunk, device=source.device)
    ).tolist()
    piece = functools.partial(_chunk, layer, temperature, entropy, entropy_grad)
    grad = torch.is_grad_enabled()
    picked, entropies = [], []
    for index, start in enumerate(range(0, slots, chunk)):
        queries = order[edges[index] : edges[index + 1]]
        args = (hidden[start : start + chunk], source[queries] - start, target[queries])
        # the backward recomputes this chunk's logits instead of keeping them
        out = checkpoint(piece, *args, use_reentrant=False) if grad else piece(*args)
        picked.append(out[0])
        entropies.append(out[1])
    # the queries back in their own order
    logprob = torch.cat(picked)[torch.argsort(order)]
    if not entropy:
        return logprob, None
    return logprob, torch.cat(entropies)


def _chunk(
    layer: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    entropy: bool,
    entropy_grad: bool,
    hidden: torch.Tensor,
    source: torch.Tensor,
    target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of `slot_logprobs`: its queries' log-probs and its slots' entropies, computed as
    `token_logprobs_entropy` does (float32 logits / temperature, gathered logit - logsumexp)."""
    scaled = layer(hidden).float()  # [chunk, vocab]
    if temperature != 1.0:
        scaled = scaled / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)  # [chunk]
    picked = scaled[source, target] - normaliser[source]
    if not entropy:
        return picked, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return picked, logits_entropy(scaled, normaliser)


def _vocab_size(layer: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> int:
    """The width of the layer's output: its out_features, or the captured logits' own width."""
    return getattr(layer, "out_features", None) or hidden.shape[-1]
