"""Vision-language policies: loading, image placeholders, and the forward inputs images need.

An image travels as its encoded bytes (PNG/JPEG) beside the token ids. In the token sequence it is
one run of image-placeholder ids (mask 0, never trainable) whose length the image processor fixes;
the model's vision tower fills those positions from `pixel_values`. Rollout engine, learner and
warm start build their forward inputs with `forward_inputs`, so all three compute the same model:
the same pixels, and the same multimodal (M-RoPE) positions for left- or right-padded rows.
"""

import io
import json
from functools import lru_cache
from pathlib import Path

import torch

VISION_MARKERS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def is_vision_language(path):
    return "vision_config" in json.loads(Path(path, "config.json").read_text())


def load_policy(path, dtype="float32"):
    """A causal LM, or an image-text-to-text model when the checkpoint has a vision tower."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    if not is_vision_language(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    # The vision markers are input only: a sampled image placeholder has no image behind it. Their
    # logits are -inf in every forward (engine, learner, warm start), so no distribution ever gives
    # them mass.
    vocab = model.config.get_text_config().vocab_size
    markers = [getattr(model.config, key, None) for key in VISION_MARKERS]
    banned = torch.tensor([i for i in markers if i is not None and i < vocab])
    model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, logits: logits.index_fill(-1, banned, float("-inf"))
    )
    return model


class ImageCodec:
    """A checkpoint's image processor: placeholder count per image, and pixel batches."""

    def __init__(self, path):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.processor = AutoImageProcessor.from_pretrained(path)
        self.placeholder_id = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(
            "<|image_pad|>"
        )
        self.merge = self.processor.merge_size**2
        self._cached = lru_cache(maxsize=4096)(self._process)

    def _process(self, image):
        from PIL import Image

        out = self.processor([Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"][0]  # [patches, channels*patch*patch], [3]

    def placeholders(self, image):
        return int(self._cached(image)[1].prod()) // self.merge

    def expand(self, ids, images):
        """Replace the k-th single placeholder in `ids` by as many as `images[k]` takes."""
        out = []
        remaining = iter(images)
        for token in ids:
            if token == self.placeholder_id:
                out.extend([token] * self.placeholders(next(remaining)))
            else:
                out.append(token)
        return out

    def pixels(self, images):
        pixel_values, grids = zip(*map(self._cached, images), strict=True)
        return {"pixel_values": torch.cat(pixel_values), "image_grid_thw": torch.stack(grids)}


def forward_inputs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    images: list[list[bytes]] | None = None,
    codec: ImageCodec | None = None,
):
    """Keyword inputs of a full forward over padded rows: position ids that skip padding (3-row
    M-RoPE positions for a vision-language model) and, when any row has images, their pixels in row
    order."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if codec is None:
        inputs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [batch, seq]
        return inputs
    flat = [image for row in images or [] for image in row]
    if flat:
        inputs.update(codec.pixels(flat))
    kinds = (input_ids == codec.placeholder_id).int()
    grid = inputs.get("image_grid_thw")
    # M-RoPE positions [3, batch, seq]
    inputs["position_ids"], _ = model.model.get_rope_index(input_ids, kinds, grid, attention_mask)
    return inputs
