"""The ``"ulysses"`` mask function and the guard's rules for masks (docs/hf_families.md, "What the
guard refuses").

transformers asks the mask function for a mask; the attention builds none (causal by flag,
windows and chunks from the layer, documents from the lengths), so the mask function's job is
to refuse what the attention cannot honour, the same on every rank: a padding mask, a custom
mask, or a mask the model overlays on the causal one (`mask_request_problem`: found from
transformers' mask-function closures, `never_opens_later`, or by probing above the diagonal,
`_sees_later_tokens`). The ranks agree on the problem through one small all-reduce, skipped
where the inputs were agreed already (`_agreed_inputs`).
"""

import sys
from typing import Optional

import torch
from torch import nn

from ...distributed.collectives import first_message, max_over_ranks
from ..context import SequenceParallelContext, require_default_context
from ..families.attention.gemma3 import honours_blocks
from ..families.vision.vision_shard import SHARD_KEY, unpads
from ..model import NotSequenceParallelError, refusal
from .attach import context_for_config, model_context
from .guard import config_problem


def mask_request_problem(mask_kwargs: dict) -> Optional[str]:
    """What a mask request (the keyword arguments transformers passes the mask function)
    asks for beyond a causal mask, a sliding window, Llama 4's chunks or packed documents,
    or None."""
    # A bidirectional request (create_bidirectional_mask) needs nothing: without padding it
    # is no mask, and the attention follows the module's is_causal (config_problem refuses
    # config.is_causal=False, which asks causal-by-module layers for a bidirectional mask).
    if "allow_is_bidirectional_skip" in mask_kwargs:
        return None
    if mask_kwargs.get("use_vmap"):
        return ("the model overlays its own mask function on the causal mask (or_mask_function / "
                "and_mask_function)")
    if mask_kwargs.get("allow_is_causal_skip", True) is False and not never_opens_later(mask_kwargs.get("mask_function")) \
            and _sees_later_tokens(mask_kwargs):
        return ("the model's mask lets tokens attend to later tokens (a bidirectional block, for instance Gemma 3's "
                "image tokens from token_type_ids), which causal attention over sequence shards does not honour")
    return None


_MASKS = "transformers.masking_utils"


def _closure(fn) -> dict:
    """The variables a transformers mask-function closure captured, by name."""
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    cells = getattr(fn, "__closure__", None) or ()
    return {name: cell.cell_contents for name, cell in zip(names, cells)}


def _qualname(fn) -> str:
    """A function's qualified name, from its code object (which torch.compile's tracing
    lets us read, where it hides `__qualname__` of a closure built inside the trace)."""
    code = getattr(fn, "__code__", None)
    return getattr(code, "co_qualname", None) or getattr(fn, "__qualname__", None) or ""


def never_opens_later(mask_function) -> bool:
    """The mask function is causal by its construction in transformers' mask utilities: the
    causal function itself, an intersection with it (a window, chunks, padding), offsets
    of it, or positions remapped per packed sequence intersected with those sequences
    (inside one, positions step by 1, so their order is the tokens'). Read from the closures,
    no evaluation, so no host read: what transformers builds for a plain causal request
    while compiling, which the probe (`_sees_later_tokens`) would break the graph on."""
    if getattr(mask_function, "__module__", None) != _MASKS:
        return False
    name = _qualname(mask_function)
    if name == "causal_mask_function":
        return True
    captured = _closure(mask_function)
    if name == "add_offsets_to_mask_function.<locals>.inner_mask":
        return never_opens_later(captured.get("mask_function"))
    members = captured.get("mask_functions", ())
    if name == "or_masks.<locals>.or_mask":
        return bool(members) and all(never_opens_later(m) for m in members)
    if name != "and_masks.<locals>.and_mask":
        return False
    if any(never_opens_later(m) for m in members):
        return True
    names = [_qualname(m) for m in members]
    remapped = [_closure(m).get("mask_function") for m, n in zip(members, names)
                if n == "remap_positions_for_packed_sequence.<locals>.inner_mask"]
    return "packed_sequence_mask_function.<locals>.inner_mask" in names and any(map(never_opens_later, remapped))


def _sees_later_tokens(mask_kwargs: dict) -> bool:
    """Probe the mask function on the diagonal above the causal one (query i, key i + 1)
    of every row: a causal mask (with windows, chunks, documents) is False there; an
    overlay that opens blocks both ways is True somewhere. O(S) index evaluations."""
    import torch

    mask_function = mask_kwargs.get("mask_function")
    q_length, kv_length = mask_kwargs.get("q_length"), mask_kwargs.get("kv_length")
    if mask_function is None or not q_length or not kv_length:
        return False
    q_offset, kv_offset = int(mask_kwargs.get("q_offset", 0) or 0), int(mask_kwargs.get("kv_offset", 0) or 0)
    batch = int(mask_kwargs.get("batch_size", 1) or 1)
    device = mask_kwargs.get("device")
    q = torch.arange(q_offset, q_offset + q_length, device=device)
    q = q[q + 1 < kv_offset + kv_length]
    if q.numel() == 0:
        return False
    rows = torch.arange(batch, device=device).repeat_interleave(q.numel())
    q = q.repeat(batch)
    try:
        opened = mask_function(rows, torch.zeros_like(q), q, q + 1)
    except Exception:  # noqa: BLE001 - a mask function that cannot be probed is not known to be causal
        return True
    return bool(torch.as_tensor(opened).any())


# What a mask request can ask for that the attention cannot honour: one code per problem,
# so that the ranks agree on the largest code and raise the same error (the message of a
# code never depends on this rank's inputs).
_MASK_PROBLEMS = {
    1: (ValueError, "a padding attention_mask (with zeros) is not supported"),
    2: (ValueError, "a custom (not 2-D) or non-tensor attention mask is not supported"),
    3: (NotSequenceParallelError, None),   # the model's own request: mask_request_problem's text
}


_MASK_REQUEST_ADVICE = ("Run it without sequence parallelism, or without the inputs that ask for that mask (for "
                        "Gemma 3, text without token_type_ids marking image tokens).")


_SHARD_BATCH_ADVICE = ("Sequence-parallel training expects unpadded (optionally packed) batches: pass the padding "
                       "mask to shard_batch(..., attention_mask=mask), which unpads the batch, and call the model "
                       "with batch.model_inputs() (no attention_mask).")


def _padding_code(attention_mask) -> int:
    if attention_mask is None:
        return 0
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return 2
    return 1 if not bool(attention_mask.bool().all()) else 0


def _calling_model(config) -> Optional[nn.Module]:
    """The outermost module whose forward is running with this config: transformers hands
    the mask function the config, not the model, and the model is needed to check it once
    (a model met first by its forward, not by an entry point)."""
    frame, found = sys._getframe(2), None
    for _ in range(48):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and getattr(owner, "config", None) is config:
            found = owner
        frame = frame.f_back
    return found


def mask_context(config) -> SequenceParallelContext:
    """The context of the model whose forward asks for a mask; a model met here for the
    first time gets the default context and is checked (guard.py)."""
    context = context_for_config(config)
    if context is not None:
        return context
    model = _calling_model(config)
    if model is not None:
        return model_context(model)
    if config is not None:
        problem = config_problem(config)
        if problem:
            raise refusal(None, f"model_type {getattr(config, 'model_type', '?')!r}: {problem}")
    return require_default_context()


def ulysses_mask_function(*args, attention_mask=None, config=None, **kwargs):
    """Mask function registered in `AttentionMaskInterface` for ``"ulysses"``.

    Builds nothing (returns None): the attention is causal by flag, windows and chunks
    come from each layer, packed documents from the position ids. A 2-D padding mask
    with zeros, a custom mask, and a mask the model overlays on the causal one (guard.py,
    `mask_request_problem`) raise on every rank of the SP group (the ranks agree on the
    problem through one small all-reduce per call, so nobody hangs). That agreement is
    skipped where there is nothing to agree on: no mask, a plain causal request, and inputs
    agreed where the batch was seen (`_agreed_inputs`: shard_batch's keys, generation), so
    the documented training step and every decode step do no collective and no host read
    here. The model whose forward this is gets checked the first time (`mask_context`).
    """
    context = mask_context(config)
    request = mask_request_problem(kwargs)
    shard = context.forward_inputs.get(SHARD_KEY)
    if request and honours_blocks(kwargs, shard):
        request = None   # Gemma 3's image blocks, which this forward's attention honours (vision.py)
    if unpads(shard, attention_mask):
        attention_mask = None   # a VLM's whole padded batch, before its language model unpads it (vision.py)
    code = 3 if request else _padding_code(attention_mask)
    if code == 0 and attention_mask is None and _plain_request(kwargs) and _agreed_inputs(context):
        return None   # nothing to agree on: no collective, no host read
    group, _, _ = context.ulysses()
    code = max_over_ranks(code, group)
    if context.ring_group is not None:  # a ring group meets every Ulysses group: the max over the grid
        code = max_over_ranks(code, context.ring()[0])
    if code:
        error, text = _MASK_PROBLEMS[code]
        if error is NotSequenceParallelError:
            raise refusal(None, _first_request(request, context), _MASK_REQUEST_ADVICE)
        raise ValueError(f"ulysses attention: {text}. {_SHARD_BATCH_ADVICE}")
    return None


def _plain_request(mask_kwargs: dict) -> bool:
    """A request for the causal mask itself (windows and documents come from the layers and
    the lengths): no overlay of the model's, which could open tokens on some ranks' data
    only; causal by construction when transformers says it cannot skip it (compiling)."""
    if mask_kwargs.get("use_vmap"):
        return False
    return mask_kwargs.get("allow_is_causal_skip", True) is not False or never_opens_later(mask_kwargs.get("mask_function"))


def _agreed_inputs(context) -> bool:
    """This forward's inputs were agreed where the batch was seen: `shard_batch`'s keys
    (every rank holds the same whole batch and cut it the same way) or a chunk of `generate`
    / `prefill` (the prompt compared over the group first). A rank with no mask and a plain
    request then knows every rank has none: the mask function needs no agreement."""
    return context.inference_cache is not None or context.forward_inputs.get("ulysses_seq_lens") is not None


def _first_request(request, context) -> str:
    """The lowest rank's mask request problem, the same text on every rank (error path only)."""
    found = first_message(request, context.ulysses()[0])
    if context.ring_group is not None:
        found = first_message(found[1] if found else None, context.ring()[0])
    return found[1] if found else "a mask request the attention cannot honour"
