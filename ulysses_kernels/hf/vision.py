"""Vision-language models under sequence parallelism: merge, then shard
(docs/hf.md, "Vision-language models").

A VLM's forward embeds the text, runs its vision tower on the images and videos, writes the
features over the placeholder tokens (the merge) and numbers the tokens (Qwen's 3-D mRoPE
positions, computed over the whole row). Every rank of the SP group holds the same whole
batch (`shard_batch(..., pixel_values=...)`), so:

* **The merge runs on the whole sequence**, in the model's own code, on every rank.
* **Then the shard.** A forward pre-hook on the language model (`TokenShard.language_inputs`)
  cuts what the merge hands it to this rank's tokens: `inputs_embeds`, the position ids (each
  of the mRoPE rows), Qwen3-VL's `visual_pos_masks` and the rows of its deepstack features
  that belong to this rank's visual tokens. A padded batch is unpadded as for text (its rows
  packed into one, `batch.py`); the shards are `shard_batch`'s (uneven, zigzag on a ring). A
  per-token input the hook does not know is refused on every rank, never passed on whole.
* **Documents** are the rows (and the text positions `shard_batch` derives), never the mRoPE
  rows, whose positions repeat inside an image.
* **The vision tower never goes through Ulysses**: its attention modules run transformers'
  SDPA on this rank (`is_local_attention`), whatever `attn_implementation` says.
* **vision="split"** (`split_tower_forward`): each SP rank encodes a contiguous block of the
  images (balanced by patches) and the features are all-gathered; the gather's backward sums
  every rank's gradient into the block's owner, so the tower's gradient summed over the SP
  group is the single-device one, as with "replicate" (every rank encodes every image and
  the gradient flows from its own tokens). A rank left without an image encodes a dummy one
  whose output joins the graph times 0, so every rank runs the tower (ZeRO-3 / FSDP gather
  its parameters on every rank).
* **A forward without images** on a model whose towers are sharded (ZeRO-3, FSDP2) runs
  them on a dummy image too (`_with_tower_dummy`), in the same place, for the same reason:
  a DP group whose batch has no image.
* **Generation** (`merged_prompt`): one forward merges the prompt and stops at the language
  model (`CaptureMerge`); the prefill's chunks then take their slices of the merged inputs
  (`TokenShard(merged=...)`), and transformers' own loop decodes from the model's rope
  deltas.
"""

import inspect
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..api import gather_sequence
from ..distributed.groups import resolve_group
from ..ring.shard import cut_ranges
from .guard import is_vision_config, refusal, vision_towers

SHARD_KEY = "ulysses_shard"   # the model keyword that carries a TokenShard down to the language model
BLOCKS_KEY = "ulysses_image_blocks"   # the keyword that carries Gemma 3's image blocks to the attention
IMAGE_KEYS = ("pixel_values", "pixel_values_videos")
VISION_KEYS = IMAGE_KEYS + ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids",
                            "token_type_ids")
VISION_MODES = ("replicate", "split")
# Language-model keywords the hook knows: cut per token, replaced, or passed on as they are.
_PER_TOKEN = ("inputs_embeds", "input_ids", "visual_pos_masks")
_PASSED = ("cache", "past_key_values", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
           "cache_position", "logits_to_keep")
_ATTRIBUTE_LOCAL = "_ulysses_local_attention"


# ---------------------------------------------------------------------- the model's parts

def is_local_attention(module: nn.Module) -> bool:
    """An attention module of a vision tower: it runs on this rank, never through Ulysses
    (marked by `install_vision`; a vision config when the model was never attached)."""
    return getattr(module, _ATTRIBUTE_LOCAL, False) or is_vision_config(getattr(module, "config", None))


def local_attention(module, query, key, value, attention_mask, **kwargs):
    """What a vision tower's attention runs: transformers' SDPA on this rank's tokens."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("ulysses_")}
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def language_model(model: nn.Module, layers: List[nn.Module]) -> Optional[nn.Module]:
    """The innermost transformers model holding the decoder layers (the VLM's text model)."""
    found = None
    for module in model.modules():
        if hasattr(module, "base_model_prefix") and layers and any(m is layers[0] for m in module.modules()):
            found = module
    return found


def install_vision(model: nn.Module, layers: List[nn.Module]) -> None:
    """Make a VLM sequence-parallel: its towers' attention local, the split forward on its
    towers, the shard hook on its language model. Nothing for a model without a tower."""
    towers = vision_towers(model)
    if not towers:
        return
    for tower in towers:
        for module in tower.modules():
            object.__setattr__(module, _ATTRIBUTE_LOCAL, True)
        if "forward" not in vars(tower) and _takes_grids(tower):
            tower.forward = types.MethodType(split_tower_forward, tower)
    text = language_model(model, layers)
    if text is not None and not getattr(text, "_ulysses_shard_hook", False):
        text.register_forward_pre_hook(_shard_language_inputs, with_kwargs=True, prepend=True)
        object.__setattr__(text, "_ulysses_shard_hook", True)
    if text is not None:   # vision="split" needs every tower to split its images (the hook checks)
        object.__setattr__(text, "_ulysses_towers_split", all("forward" in vars(t) for t in towers))
        object.__setattr__(text, "_ulysses_towers", tuple(towers))   # a plain attribute: not submodules


def _takes_grids(tower: nn.Module) -> bool:
    """A tower called with its patches and their grid (Qwen's): its images can be split."""
    try:
        return "grid_thw" in inspect.signature(type(tower).forward).parameters
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------- the shard

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


def _shard_language_inputs(module, args, kwargs):
    shard = kwargs.get(SHARD_KEY)
    if shard is None:   # no image in this forward
        return _with_tower_dummy(module, args, kwargs)
    if isinstance(shard, CaptureMerge):
        raise MergedInputs({k: v for k, v in kwargs.items() if k in _PER_TOKEN + ("position_ids", "deepstack_visual_embeds")})
    if args:
        raise refusal(module, "its language model is called with positional arguments, which the shard hook "
                              "cannot tell apart")
    if shard.vision == "split" and not getattr(module, "_ulysses_towers_split", False):
        raise refusal(module, "its vision tower takes whole images, not patches with their grid, so "
                              'vision="split" cannot divide them over the ranks', 'Use vision="replicate".')
    return args, shard.language_inputs(module, kwargs)


# ------------------------------------------------------------------- split vision tower

def split_tower_forward(tower, hidden_states, grid_thw=None, **kwargs):
    """A Qwen vision tower's forward: the original one, or under `vision="split"` this
    rank's block of the images followed by an all-gather of the features (module doc)."""
    original = type(tower).forward
    shard = kwargs.get(SHARD_KEY)
    if not isinstance(shard, TokenShard) or shard.vision != "split":
        return original(tower, hidden_states, grid_thw=grid_thw, **kwargs)
    group, world, rank = resolve_group(shard.group)
    if grid_thw is None or world == 1:
        return original(tower, hidden_states, grid_thw=grid_thw, **kwargs)
    patches = [int(n) for n in grid_thw.prod(-1).tolist()]
    if sum(patches) != hidden_states.shape[0]:
        raise ValueError(f"ulysses_kernels.hf: the vision inputs hold {hidden_states.shape[0]} patches but their grid "
                         f"(t x h x w per image) makes {sum(patches)}")
    bounds = balanced_blocks(patches, world)
    first, last = bounds[rank], bounds[rank + 1]
    rows = [0]
    for n in patches:
        rows.append(rows[-1] + n)
    merge = int(getattr(tower, "spatial_merge_size", 1)) ** 2
    if last > first:
        out = original(tower, hidden_states[rows[first]:rows[last]], grid_thw=grid_thw[first:last], **kwargs)
        tie = None
    else:   # no image of its own: a dummy one, so that every rank runs the tower
        patches_in, grid = _dummy_patches(tower, hidden_states.shape[1], hidden_states, grid_thw)
        out = original(tower, patches_in, grid_thw=grid, **kwargs)
        tie = out.pooler_output.sum() * 0
    counts = [sum(patches[bounds[r]:bounds[r + 1]]) // merge for r in range(world)]
    return _gathered(out, counts, first == last, tie, group)


def _gathered(out, counts, empty, tie, group):
    """The tower's output with its features (pooled, and deepstack) gathered over `group`;
    `last_hidden_state` (patch level, this rank's images only) is dropped."""
    def gather(local):
        if empty:
            local = local[:0] + tie
        return gather_sequence(local.unsqueeze(0), group, dim=1, seq_lens=counts).squeeze(0)

    values = {"pooler_output": gather(out.pooler_output)}
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack is not None:
        values["deepstack_features"] = [gather(f) for f in deepstack]
    return type(out)(**values)


def balanced_blocks(sizes: List[int], world: int) -> List[int]:
    """Contiguous blocks of items, one per rank, balanced by size: `bounds` with rank r
    holding items `bounds[r]:bounds[r + 1]` (cut at the item boundary nearest each r / world
    of the total)."""
    total, cum = sum(sizes), [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    bounds = [0]
    for r in range(1, world):
        target = total * r / world
        best = min(range(bounds[-1], len(sizes) + 1), key=lambda i: (abs(cum[i] - target), i))
        bounds.append(best)
    return bounds + [len(sizes)]


# ----------------------------------------------------- a sharded tower without images

def parameters_sharded(module: nn.Module) -> bool:
    """The module's parameters are gathered by the ranks together when it runs: DeepSpeed
    ZeRO-3 (`ds_id`) or FSDP2 (DTensor parameters)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # a torch without DTensor
        DTensor = ()
    return any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in module.parameters())


def _with_tower_dummy(module: nn.Module, args, kwargs):
    """The language model's inputs of a forward without images, on a model whose vision
    towers are sharded (ZeRO-3, FSDP2): every tower run on a dummy image, its output added
    to `inputs_embeds` times zero. The towers then run where a forward with images runs
    them (before the language model) and their backward where its backward does, so this
    rank gathers their parameters and reduces their gradients with the ranks whose batches
    have images. Unchanged (None) otherwise."""
    towers = [t for t in getattr(module, "_ulysses_towers", ()) if parameters_sharded(t)]
    embeds = kwargs.get("inputs_embeds")
    if not towers or not isinstance(embeds, torch.Tensor):
        return None
    dummy = sum(_dummy_output(tower).sum() * 0 for tower in towers)
    return args, dict(kwargs, inputs_embeds=embeds + dummy.to(embeds.dtype))


def _dummy_patches(tower: nn.Module, width: int, like: torch.Tensor, grid_like: torch.Tensor):
    """One all-zero image of a Qwen tower, as (patch rows `[merge**2, width]` like `like`,
    its grid `[[1, merge, merge]]` like `grid_like`): the smallest image it merges."""
    side = int(getattr(tower, "spatial_merge_size", None) or getattr(tower.config, "spatial_merge_size", 1))
    return like.new_zeros(side * side, width), grid_like.new_tensor([[1, side, side]])


def _dummy_output(tower: nn.Module) -> torch.Tensor:
    """The tower on one small all-zero image: Qwen's patches with their grid, or whole
    pixels (SigLIP)."""
    config = tower.config
    weight = next(p for p in tower.parameters() if p.is_floating_point())
    device, dtype = weight.device, weight.dtype
    if _takes_grids(tower):
        width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        like = torch.empty(0, width, device=device, dtype=dtype)
        patches, grid = _dummy_patches(tower, width, like, torch.empty(0, 3, dtype=torch.long, device=device))
        return tower(patches, grid_thw=grid).pooler_output
    channels = getattr(config, "num_channels", 3)
    out = tower(pixel_values=torch.zeros(1, channels, config.image_size, config.image_size, device=device, dtype=dtype))
    return out.last_hidden_state


# ------------------------------------------------------------------------ the inputs

def vision_inputs(given: Dict[str, object]) -> Dict[str, torch.Tensor]:
    """The multimodal inputs among `given` that are set."""
    return {k: v for k, v in given.items() if k in VISION_KEYS and v is not None}


def has_images(inputs: Dict[str, object]) -> bool:
    return any(inputs.get(k) is not None for k in IMAGE_KEYS)


def check_vision_mode(vision: str) -> None:
    if vision not in VISION_MODES:
        raise ValueError(f"ulysses_kernels.hf: vision must be one of {VISION_MODES}, got {vision!r}")


def merged_prompt(model: nn.Module, input_ids: torch.Tensor, inputs: Dict[str, torch.Tensor]) -> dict:
    """The language model's inputs of the whole prompt, merged by the model's own forward
    (which also sets the rope deltas its generation continues from)."""
    try:
        model(input_ids=input_ids, use_cache=False, **inputs, **{SHARD_KEY: CaptureMerge()})
    except MergedInputs as merged:
        return merged.inputs
    raise refusal(model, "its forward did not reach its language model through a module ulysses_kernels can hook")


# ------------------------------------------------- bidirectional image blocks (Gemma 3)

def unpads(shard, attention_mask) -> bool:
    """`attention_mask` is the padding of the whole batch that `shard` unpads (a VLM's
    outer model asks for masks over the whole batch before its language model takes the
    shard; the attention then sees the packed rows)."""
    padding = getattr(shard, "padding", None)
    if padding is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 \
            or tuple(attention_mask.shape) != tuple(padding.shape):
        return False
    return bool(torch.equal(attention_mask.bool(), padding.valid_mask().to(attention_mask.device)))


def image_blocks(token_type_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Gemma 3's image blocks: `[B, S]`, each run of image tokens (`token_type_ids` 1) one
    block with an id of its own in the batch, -1 at text; None when there is no image token.
    Inside a block the tokens attend to each other both ways (transformers'
    `get_block_sequence_ids_for_mask`)."""
    image = token_type_ids == 1
    if not bool(image.any()):
        return None
    previous = torch.nn.functional.pad(image, (1, 0))[:, :-1]
    starts = (image & ~previous).reshape(-1)
    ids = (starts.long().cumsum(0) - 1).view_as(image)
    return torch.where(image, ids, torch.full_like(ids, -1))


def honours_blocks(mask_kwargs: dict, shard) -> bool:
    """A mask request (the model's `mask_function` over the whole batch) that opens exactly
    `shard`'s image blocks above the diagonal: each block's first token sees its last, a
    token sees the next one iff both are in one block, and a block never sees the next
    block. Probed at O(S) points, as the guard probes any mask (guard.py)."""
    blocks = getattr(shard, "blocks", None)
    mask_function = mask_kwargs.get("mask_function")
    if blocks is None or mask_function is None or int(mask_kwargs.get("q_offset", 0) or 0) \
            or int(mask_kwargs.get("kv_offset", 0) or 0) or mask_kwargs.get("q_length") != blocks.shape[1]:
        return False
    rows, q, kv, want = _block_probes(blocks.to(mask_kwargs.get("device") or blocks.device))
    try:
        opened = torch.as_tensor(mask_function(rows, torch.zeros_like(q), q, kv))
    except Exception:  # noqa: BLE001 - a mask function that cannot be probed is not known to be these blocks
        return False
    return bool((opened.bool() == want).all())


def _block_probes(blocks: torch.Tensor):
    """(rows, queries, keys, expected) of `honours_blocks`' probes."""
    B, S = blocks.shape
    row = torch.arange(B, device=blocks.device).repeat_interleave(S - 1)
    q = torch.arange(S - 1, device=blocks.device).repeat(B)
    flat = blocks[:, :-1].reshape(-1), blocks[:, 1:].reshape(-1)
    probes = [(row, q, q + 1, (flat[0] == flat[1]) & (flat[0] >= 0))]
    ids = blocks.reshape(-1)
    image = torch.nonzero(ids >= 0).flatten()
    if image.numel():
        block = ids[image]
        first = torch.full((int(block.max()) + 1,), ids.numel(), device=blocks.device).scatter_reduce(0, block, image, "amin")
        last = torch.zeros_like(first).scatter_reduce(0, block, image, "amax")
        present = first < ids.numel()
        first, last = first[present], last[present]
        probes.append((first // S, first % S, last % S, torch.ones_like(first, dtype=torch.bool)))
        same_row = (first[1:] // S) == (last[:-1] // S)   # a block never sees the next one in its row
        probes.append(((last[:-1] // S)[same_row], (last[:-1] % S)[same_row], (first[1:] % S)[same_row],
                       torch.zeros(int(same_row.sum()), dtype=torch.bool, device=blocks.device)))
    return tuple(torch.cat(parts) for parts in zip(*probes))


def block_attention(context, module, query, key, value, *, lens, cu_seqlens, blocks, scaling, window_size,
                    softcap, sinks):
    """Causal attention opened both ways inside each image block (Gemma 3), on the
    reference path: the heads of the whole sequence on each rank (`ulysses_head_parallel`),
    the mask built over it (documents, the window's left bound, causal OR same block, as
    transformers composes them), softmax in float32 at least. Another path (a kernel
    without such a mask), a ring, or sinks: refused on every rank."""
    from ..api import resolve_path, ulysses_head_parallel

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    path = resolve_path(context.backend, q.device, distributed=True, tensors=(q, k, v))
    problem = ("a ring of more than one rank" if context.ring()[1] > 1 else
               f"the {path} path (its kernels have no such mask)" if path != "reference" else
               "attention sinks" if sinks is not None else None)
    if problem:
        raise refusal(module, f"its image tokens attend to each other both ways (token_type_ids); the bidirectional "
                              f"blocks run on the reference path of pure Ulysses, not with {problem}",
                      'Use backend="reference" and ring_size=1, or drop token_type_ids (causal image tokens).')
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    allowed = _block_mask(blocks, cu_seqlens, window_size[0], sum(lens), q.device)
    group_size = q.shape[2] // k.shape[2]

    def attend(local, heads):
        kv_heads = list(heads.heads("k"))
        pick = torch.tensor([kv_heads.index(h // group_size) for h in heads.heads("q")], device=q.device)
        qh = local["q"]
        compute = torch.float64 if qh.dtype == torch.float64 else torch.float32
        kh, vh = local["k"].index_select(2, pick), local["v"].index_select(2, pick)
        scores = torch.einsum("bqhd,bkhd->bhqk", qh.to(compute), kh.to(compute)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", probs, vh.to(compute)).to(qh.dtype)

    return ulysses_head_parallel(attend, dict(q=q, k=k, v=v), context.group, seq_lens=lens)


def _block_mask(blocks, cu_seqlens, left, total, device):
    """`[B, 1, T, T]`: key k visible to query q (same document; k >= q - left when the
    window is bounded; k <= q, or both in one image block)."""
    idx = torch.arange(total, device=device)
    blocks = blocks.to(device)
    if cu_seqlens is not None:
        document = torch.bucketize(idx, cu_seqlens.to(device=device, dtype=torch.int64)[1:], right=True)
        same_document = document[:, None] == document[None, :]
    else:
        same_document = torch.ones(total, total, dtype=torch.bool, device=device)
    causal = idx[None, :] <= idx[:, None]
    same_block = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    allowed = same_document & (causal | same_block)
    if left >= 0:
        allowed = allowed & (idx[None, :] >= idx[:, None] - left)
    return allowed.unsqueeze(1)
