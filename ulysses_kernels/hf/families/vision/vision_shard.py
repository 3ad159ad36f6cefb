"""What one rank takes of a vision-language model's merged sequence (`TokenShard`), and the
keywords that carry it from `shard_batch` and `prefill` down to the language model
(docs/hf_vlm.md, "Vision-language models"; the hook that applies it: vision.py)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ....ring.shard import cut_ranges
from ...model import refusal
from ..attention.gemma3 import BLOCKS_KEY

SHARD_KEY = "ulysses_shard"   # the model keyword that carries a TokenShard down to the language model


IMAGE_KEYS = ("pixel_values", "pixel_values_videos")


VISION_KEYS = IMAGE_KEYS + ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids",
                            "token_type_ids")


VISION_MODES = ("replicate", "split")


# Language-model keywords the hook knows: cut per token, replaced, or passed on as they are.
_PER_TOKEN = ("inputs_embeds", "input_ids", "visual_pos_masks")


_PASSED = ("cache", "past_key_values", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
           "cache_position", "logits_to_keep")


class MergedInputs(Exception):
    """Raised by the language model's hook under `CaptureMerge`: the merged inputs of a
    whole prompt, taken before the language model runs (generation)."""

    def __init__(self, inputs: dict):
        super().__init__("merged inputs captured")
        self.inputs = inputs


class CaptureMerge:
    """The shard keyword of a forward that only merges (generation's first step)."""


@dataclass
class TokenShard:
    """What this rank takes of the merged sequence: the whole batch's shape `(B, S)`, its
    padding (`PaddingInfo`, or None), the global (start, length) ranges of the (packed)
    sequence it holds, its text positions (the fallback for a model that passes none), how
    the vision tower runs and on which group; `merged`: the language model's inputs of a
    whole prompt (generation), cut instead of the forward's own."""

    shape: Tuple[int, int]
    ranges: List[Tuple[int, int]]
    positions: Optional[torch.Tensor] = None
    padding: Optional[object] = None
    vision: str = "replicate"
    group: Optional[object] = None
    merged: Optional[Dict[str, object]] = field(default=None, repr=False)
    blocks: Optional[torch.Tensor] = field(default=None, repr=False)   # [B, S] image blocks of the whole batch

    def packed_blocks(self) -> Optional[torch.Tensor]:
        """The image blocks over the (packed) sequence the attention sees, or None."""
        if self.blocks is None:
            return None
        return self.padding.pack(self.blocks) if self.padding is not None else self.blocks

    def cut(self, values: torch.Tensor, batch_dim: int = 0) -> torch.Tensor:
        """This rank's tokens of per-token `values` whose dims `batch_dim, batch_dim + 1`
        are the whole batch's `(B, S)`: packed when the batch was padded, then cut."""
        moved = values.movedim((batch_dim, batch_dim + 1), (0, 1))
        if tuple(moved.shape[:2]) != tuple(self.shape):
            raise ValueError(f"ulysses_kernels.hf: the merged sequence has shape {tuple(moved.shape[:2])}, but the "
                             f"batch was sharded as {tuple(self.shape)}; pass the same input_ids to the model as to "
                             "shard_batch (batch.model_inputs())")
        if self.padding is not None:
            moved = self.padding.pack(moved)
        return cut_ranges(moved, self.ranges).movedim((0, 1), (batch_dim, batch_dim + 1))

    def language_inputs(self, module: nn.Module, kwargs: dict) -> dict:
        """The language model's keywords for this rank's tokens (see the module doc)."""
        source = dict(kwargs, **self.merged) if self.merged is not None else kwargs
        out = dict(kwargs)
        unknown = sorted(k for k, v in kwargs.items() if k not in _PER_TOKEN + _PASSED + ("position_ids", "attention_mask", "deepstack_visual_embeds")
                         and not k.startswith("ulysses_") and isinstance(v, torch.Tensor) and v.dim() >= 2)
        if unknown:
            raise refusal(module, f"its language model takes a tensor input {unknown[0]!r} that ulysses_kernels does "
                                  "not know how to cut to this rank's tokens")
        for key in _PER_TOKEN:
            if isinstance(source.get(key), torch.Tensor):
                out[key] = self.cut(source[key])
        out["position_ids"] = self._positions(source.get("position_ids"), out["inputs_embeds"].device)
        out["attention_mask"] = None   # padding is gone (packed rows), documents reach the attention
        if source.get("deepstack_visual_embeds") is not None:
            out["deepstack_visual_embeds"] = self._deepstack(source["visual_pos_masks"], source["deepstack_visual_embeds"])
        if self.blocks is not None:   # Gemma 3's bidirectional image blocks reach the attention
            out[BLOCKS_KEY] = self.packed_blocks()
        return out

    def _positions(self, positions: Optional[torch.Tensor], device) -> torch.Tensor:
        if positions is not None:
            return self.cut(positions, batch_dim=positions.dim() - 2)
        if self.positions is not None:   # the model numbers the tokens itself: give it the global text positions
            return self.positions
        B, S = self.shape
        return self.cut(torch.arange(S, device=device).expand(B, S))

    def _deepstack(self, visual_mask: torch.Tensor, features: List[torch.Tensor]) -> List[torch.Tensor]:
        """The rows of each deepstack feature (one per visual token of the whole batch, in
        row-major order) that belong to this rank's visual tokens, in its order."""
        ordinal = (visual_mask.reshape(-1).long().cumsum(0) - 1).view_as(visual_mask)
        mine = self.cut(ordinal)[self.cut(visual_mask).bool()]
        return [f.index_select(0, mine.to(f.device)) for f in features]


def vision_inputs(given: Dict[str, object]) -> Dict[str, torch.Tensor]:
    """The multimodal inputs among `given` that are set."""
    return {k: v for k, v in given.items() if k in VISION_KEYS and v is not None}


def has_images(inputs: Dict[str, object]) -> bool:
    return any(inputs.get(k) is not None for k in IMAGE_KEYS)


def check_vision_mode(vision: str) -> None:
    if vision not in VISION_MODES:
        raise ValueError(f"ulysses_kernels.hf: vision must be one of {VISION_MODES}, got {vision!r}")


def unpads(shard, attention_mask) -> bool:
    """`attention_mask` is the padding of the whole batch that `shard` unpads (a VLM's
    outer model asks for masks over the whole batch before its language model takes the
    shard; the attention then sees the packed rows)."""
    padding = getattr(shard, "padding", None)
    if padding is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 \
            or tuple(attention_mask.shape) != tuple(padding.shape):
        return False
    return bool(torch.equal(attention_mask.bool(), padding.valid_mask().to(attention_mask.device)))
