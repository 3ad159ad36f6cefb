"""Vision-language models under sequence parallelism: merge, then shard
(docs/hf_vlm.md, "Vision-language models").

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
from typing import Dict, List, Optional

import torch
from torch import nn

from ....api import gather_sequence
from ....distributed.groups import resolve_group
from ...model import Anatomy, ensure_record, is_vision_config, record_of, refusal
from .vision_shard import _PER_TOKEN, SHARD_KEY, CaptureMerge, MergedInputs, TokenShard

# ---------------------------------------------------------------------- the model's parts

def is_local_attention(module: nn.Module) -> bool:
    """An attention module of a vision tower: it runs on this rank, never through Ulysses
    (marked by `install_vision`; a vision config when the model was never attached)."""
    record = record_of(module)
    return bool(record is not None and record.marked(module, "local_attention")) \
        or is_vision_config(getattr(module, "config", None))


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


def install_vision(anatomy: Anatomy) -> None:
    """Make a VLM sequence-parallel: its towers' attention local, the split forward on its
    towers, the shard hook on its language model. Nothing for a model without a tower."""
    model, layers, towers = anatomy.model, anatomy.layers, anatomy.towers
    if not towers:
        return
    record = ensure_record(model)
    for tower in towers:
        for module in tower.modules():
            record.mark(module, "local_attention")
        if "forward" not in vars(tower) and _takes_grids(tower):
            record.replace_forward(tower, types.MethodType(split_tower_forward, tower))
    text = language_model(model, layers)
    if text is not None and not record.has_hooks("vision_shard"):
        record.add_hooks("vision_shard", [text.register_forward_pre_hook(_shard_language_inputs, with_kwargs=True,
                                                                         prepend=True)])
    if text is not None:   # vision="split" needs every tower to split its images (the hook checks)
        record.mark(text, "towers_split", all(record.replaced(t) for t in towers))
        record.mark(text, "towers", tuple(towers))


# ------------------------------------------------------------------------- the shard


def _shard_language_inputs(module, args, kwargs):
    shard = kwargs.get(SHARD_KEY)
    if shard is None:   # no image in this forward
        return _with_tower_dummy(module, args, kwargs)
    if isinstance(shard, CaptureMerge):
        raise MergedInputs({k: v for k, v in kwargs.items() if k in _PER_TOKEN + ("position_ids", "deepstack_visual_embeds")})
    if args:
        raise refusal(module, "its language model is called with positional arguments, which the shard hook "
                              "cannot tell apart")
    if shard.vision == "split" and not record_of(module).marked(module, "towers_split", False):
        raise refusal(module, "its vision tower takes whole images, not patches with their grid, so "
                              'vision="split" cannot divide them over the ranks', 'Use vision="replicate".')
    return args, shard.language_inputs(module, kwargs)


# ------------------------------------------------------------------------ the inputs


def merged_prompt(model: nn.Module, input_ids: torch.Tensor, inputs: Dict[str, torch.Tensor]) -> dict:
    """The language model's inputs of the whole prompt, merged by the model's own forward
    (which also sets the rope deltas its generation continues from)."""
    try:
        model(input_ids=input_ids, use_cache=False, **inputs, **{SHARD_KEY: CaptureMerge()})
    except MergedInputs as merged:
        return merged.inputs
    raise refusal(model, "its forward did not reach its language model through a module ulysses_kernels can hook")


# ------------------------------------------------------------------- split vision tower

def _takes_grids(tower: nn.Module) -> bool:
    """A tower called with its patches and their grid (Qwen's): its images can be split."""
    try:
        return "grid_thw" in inspect.signature(type(tower).forward).parameters
    except (TypeError, ValueError):
        return False


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
        tie = (out.pooler_output * 0).sum()   # zero first: a half-precision sum could overflow to inf
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
    towers = [t for t in record_of(module).marked(module, "towers", ()) if parameters_sharded(t)]
    embeds = kwargs.get("inputs_embeds")
    if not towers or not isinstance(embeds, torch.Tensor):
        return None
    dummy = sum((_dummy_output(tower) * 0).sum() for tower in towers)
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
