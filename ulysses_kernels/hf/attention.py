"""The ``"ulysses"`` attention implementation for transformers: registration, the mask
function, packed-document boundaries from position ids, and the attention function that
calls `ulysses_kernels.ulysses_attention` on the sequence-parallel group (see the package
doc of `ulysses_kernels.hf` for the design notes)."""

import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..api import gather_sequence, ulysses_attention
from ..distributed.collectives import first_message, gather_ints, max_over_ranks
from ..distributed.groups import collective_device
from ..extensions import HF_INSTALL_HINT
from ..layout import split_lengths
from ..ring.layout import sp_lengths
from .batch import cu_seqlens_from_position_ids
from .chunked import chunked_cu_seqlens, layer_chunk_size, positions_in_documents, retune_queries, tunes_temperature
from .context import (
    ATTN_IMPLEMENTATION,
    FORWARD_INPUTS,
    SequenceParallelContext,
    context_for_config,
    context_of,
    default_context,
    meet_models_at_their_first_call,
    model_context,
    require_default_context,
    set_default_context,
)
from .guard import (
    NotSequenceParallelError,
    config_problem,
    mask_request_problem,
    never_opens_later,
    refusal,
    refuse_in_own_attention_tables,
)
from .heads import make_sequence_classification_exact, make_token_classification_exact
from .vision import (
    BLOCKS_KEY,
    SHARD_KEY,
    block_attention,
    honours_blocks,
    is_local_attention,
    local_attention,
    unpads,
)


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(f"ulysses_kernels.hf needs Hugging Face transformers: {HF_INSTALL_HINT}") from exc
    return transformers


# ------------------------------------------------------------------ the default context

def set_sequence_parallel_group(group, *, ring_group=None, backend: Optional[str] = None) -> None:
    """Set the default context (context.py): the SP process group (and optionally the
    `ulysses_attention` backend) of models without a context of their own. `group=None`
    means the default group.

    Ulysses x Ring: pass the Ulysses group and `ring_group`, or simply the `ParallelGroups`
    returned by `init_sequence_parallel(sp, ring_size=R)`."""
    set_default_context(SequenceParallelContext(group, ring_group=ring_group, backend=backend))


def get_sequence_parallel_group():
    """The SP group of the default context (None: the default group, or none set)."""
    context = default_context()
    return context.group if context is not None else None


def get_attention_backend() -> Optional[str]:
    """The backend of the default context (None: automatic)."""
    context = default_context()
    return context.backend if context is not None else None


def register(group=None, *, ring_group=None, backend: Optional[str] = None, name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the ``"ulysses"`` attention (and its mask function) with transformers and
    set the default context: the groups of every model without a context of its own
    (`attach_context` gives a model its own). Returns the implementation name to pass as
    `attn_implementation` (to `from_pretrained`/`from_config`, or
    `model.set_attn_implementation(name)`).

    Idempotent; call it on every rank before building the model.
    """
    _require_transformers()
    from transformers import AttentionInterface

    AttentionInterface.register(name, ulysses_attention_forward)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:  # older transformers: no mask interface, masks reach the attention
        AttentionMaskInterface = None
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(name, ulysses_mask_function)
    refuse_in_own_attention_tables(name)
    make_sequence_classification_exact()
    make_token_classification_exact()
    meet_models_at_their_first_call()
    set_sequence_parallel_group(group, ring_group=ring_group, backend=backend)
    return name


# ----------------------------------------------------------------------------- masks

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


# ------------------------------------------------------------------ packed documents

def _global_positions(position_ids, group, world, ring_group=None):
    """All-gather the local position-id shard along the sequence (fallback path); returns
    the global positions and every SP rank's length."""
    pos = position_ids
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    pos = pos.detach().to(torch.int64)
    if ring_group is not None:
        dev = collective_device(ring_group)
        full = gather_sequence(pos.to(dev), group, dim=1, ring_group=ring_group).to(position_ids.device)
        return full, sp_lengths(full.shape[1], dist.get_world_size(ring_group), world)
    if group is None or world == 1:
        return pos, [pos.shape[1]]
    dev = collective_device(group)
    full = gather_sequence(pos.to(dev), group, dim=1).to(position_ids.device)
    return full, split_lengths(full.shape[1], world)


def _lengths_only(local_len, group, ring_group=None):
    """Every SP rank's local length (ring rank major with a ring)."""
    lens = [n for (n,) in gather_ints([local_len], group)]
    if ring_group is not None:
        lens = [n for row in gather_ints(lens, ring_group) for n in row]
    return lens


def _warn_local_positions(context, pos, lens):
    if context.warned_local_positions or len(lens) <= 1:
        return
    starts, s = [], 0
    for n in lens:
        starts.append(s)
        s += n
    row = pos[0]
    if all(n > 0 for n in lens) and all(int(row[st]) == 0 for st in starts) and \
            bool(((row[1:] - row[:-1]) != 1).sum() == len(lens) - 1):
        context.warned_local_positions = True
        warnings.warn("ulysses attention: every rank's position_ids start at 0 exactly at the shard "
                      "boundaries; if the model was called without global position_ids, RoPE and the "
                      "document boundaries are wrong. Use ulysses_kernels.hf.shard_batch (it passes "
                      "global position ids).", RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------------ attention

_UNSUPPORTED_KW = {
    "position_bias": "an additive position bias",
}

# The keyword arguments the attention function reads (`layer_variants`, FORWARD_INPUTS) or may
# ignore because they do not change its result: flags of the forward, the cache (generation
# runs on the package's own), and transformers' varlen boundaries, which its collators
# derive from the position ids the package reads the documents from.
_READ_OR_HARMLESS_KW = frozenset(FORWARD_INPUTS) | {
    "sliding_window", "softcap", "s_aux", "sinks",
    "use_cache", "output_attentions", "output_hidden_states", "output_router_logits", "return_dict",
    "logits_to_keep", "labels", "cache_position", "past_key_values", "past_key_value", "layer_idx",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
}
# What a sparse attention selects keys with: never honoured here, wherever it comes from.
_SELECTION_KW = frozenset({"indices", "block_indices", "topk_indices", "selected_indices", "block_mask",
                           "attention_bias"})


def ignored_keyword_problem(kwargs, model_keys=frozenset()) -> Optional[str]:
    """The keyword arguments with a value that the attention function would ignore and that
    may change its result, named (None: there are none): a key selection (`_SELECTION_KW`),
    or any keyword the model's own layers added on the way down, which is not among the
    inputs given to its transformers models (`model_keys`: a collator's extra inputs, such
    as Qwen2-VL's `second_per_grid_ts`, travel down as keywords too, and are theirs)."""
    ignored = sorted(k for k, v in kwargs.items() if v is not None and k not in _READ_OR_HARMLESS_KW
                     and (k in _SELECTION_KW or k not in model_keys))
    return ", ".join(f"{k}=" for k in ignored) if ignored else None


def layer_variants(module: nn.Module, kwargs, causal: bool) -> dict:
    """The attention variants (docs/api.md, "Attention variants") of one transformers
    attention call, from the per-layer arguments the model passes (so per-layer types,
    Gemma's alternating `layer_types` or Qwen2's `max_window_layers`, follow):
    `sliding_window=W` (the last W keys, the query included: `window_size=(W - 1, 0)`;
    both sides without a causal mask), `softcap` (Gemma 2) and `s_aux` / `sinks` (GPT-OSS,
    the module's `[Hq]` parameter over the global heads)."""
    sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    window = (-1, -1)
    if sliding is not None and int(sliding) > 0:
        window = (int(sliding) - 1, 0 if causal else int(sliding) - 1)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    return dict(window_size=window, softcap=kwargs.get("softcap") or 0.0, sinks=sinks)


def ulysses_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              is_causal: Optional[bool] = None, **kwargs):
    """transformers attention function (``AttentionInterface``) running Ulysses attention
    on the groups of the module's context (context.py; the default one of `register` for
    a model without its own).

    query `[B, Hq, S_local, D]`, key `[B, Hkv, S_local, D]`, value `[B, Hkv, S_local, Dv]`
    (transformers' layout) -> (`[B, S_local, Hq, Dv]`, None), like `sdpa_attention_forward`;
    sliding windows, softcap and sinks from the layer's arguments (`layer_variants`),
    Llama 4's chunks and temperature tuning from the module (chunked.py).
    """
    if is_local_attention(module):   # a vision tower's attention: this rank's images, never Ulysses
        return local_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               is_causal=is_causal, **kwargs)
    context = context_of(module) or require_default_context()
    context.attention_calls += 1
    where = f"ulysses attention ({type(module).__name__})"
    if attention_mask is not None:
        raise refusal(None, f"{where} got a {attention_mask.dim()}-D attention mask that the model built itself; "
                            "it cannot be honoured over sequence shards",
                      "Pass unpadded (packed) batches and let position_ids mark documents "
                      "(ulysses_kernels.hf.shard_batch), or use a model that builds its masks through "
                      "transformers' mask interface.")
    if dropout and dropout > 0.0:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported (set "
                         "config.attention_dropout = 0.0)")
    for kw, what in _UNSUPPORTED_KW.items():
        if kwargs.get(kw) is not None:
            raise refusal(None, f"{where}: {what} ({kw}) is added to the scores by the model itself")
    # the keys of the last forward's models: a checkpointed layer recomputed in the backward
    # runs outside the forward's hooks, on that forward's inputs
    ignored = ignored_keyword_problem(kwargs, context.forward_keys)
    if ignored:
        raise refusal(None, f"{where} got {ignored}, which the attention function does not honour (a sparse "
                            "attention's selection, a bias or another input that changes the result)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    variants = layer_variants(module, kwargs, bool(causal))
    chunk = layer_chunk_size(module)
    if context.inference_cache is not None:   # hf.prefill / hf.generate: a chunk over the KV cache
        return context.inference_cache.attention(query, key, value, scaling, causal, module=module,
                                                 attention_chunk=chunk, **variants), None
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{where}: query length {query.shape[2]} != key length {key.shape[2]}; a KV cache "
                         "outside generation, or attention over keys the queries are not (compressed or "
                         "cross-attention): train with use_cache=False, generate with "
                         "ulysses_kernels.hf.generate / prefill")
    lens, documents, trusted = lengths_and_documents(context, query.shape[2], kwargs)
    blocks = kwargs.get(BLOCKS_KEY, context.forward_inputs.get(BLOCKS_KEY))
    if blocks is not None:   # Gemma 3's image tokens attend both ways inside each image
        return block_attention(context, module, query, key, value, lens=lens, cu_seqlens=documents, blocks=blocks,
                               scaling=scaling, **variants), None
    cu_seqlens = documents if chunk is None else _chunk_documents(context, documents, sum(lens), chunk, query, where)
    if cu_seqlens is not None and query.shape[0] != 1:
        raise ValueError(f"{where}: packed documents need batch size 1, got {query.shape[0]}")
    if tunes_temperature(module):   # HF scaled by arange(S_local): rescale by the tokens' true positions
        true = positions_in_documents(context.token_ranges(lens), documents, query.device)
        query = retune_queries(module, query, torch.arange(query.shape[2], device=query.device), true)

    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    # Untrusted inputs are checked across the ranks by the first layer of a forward; its
    # later layers run the same model on the same lengths, so they vouch with those.
    vouched = trusted or context.forward_memo.get("checked_lengths") == lens
    out = ulysses_attention(q, k, v, group=context.ulysses()[0], causal=bool(causal), softmax_scale=scaling,
                            seq_lens=lens if vouched else None, cu_seqlens=cu_seqlens,
                            backend=context.backend, ring_group=context.ring_group, engine=context.engine,
                            **variants)
    if not vouched and context.depth > 0:   # inside a hooked forward: its memo is this forward's
        context.forward_memo["checked_lengths"] = list(lens)
    return out, None


def lengths_and_documents(context, local_len: int, kwargs):
    """(every SP rank's length, global cu_seqlens or None, trusted?) of this forward (this
    rank holding `local_len` tokens): from
    shard_batch's keys when given (to the attention, or to the model: context.py keeps the
    model's inputs), else derived from the position ids, else the lengths only (one
    document per row). Derived (a collective) once per forward, not once per layer."""
    group, world, _ = context.ulysses()
    given = {key: kwargs[key] for key in FORWARD_INPUTS if kwargs.get(key) is not None}
    inputs = dict(context.forward_inputs, **given)
    seq_lens = inputs.get("ulysses_seq_lens")
    cu_seqlens = inputs.get("ulysses_cu_seqlens")
    if seq_lens is not None:
        _not_recomputed_from_kept(given, ("ulysses_seq_lens", "ulysses_cu_seqlens") if cu_seqlens is not None
                                  else ("ulysses_seq_lens",))
        return [int(n) for n in seq_lens], cu_seqlens, True
    pos = inputs.get("position_ids")
    derived = pos if isinstance(pos, torch.Tensor) and pos.shape[-1] == local_len else local_len
    memo = context.forward_memo.get("lengths") if context.depth > 0 else None   # inside a hooked forward only
    same = memo is not None and (memo[0] is derived or (isinstance(derived, int) and isinstance(memo[0], int)
                                                       and memo[0] == derived))
    if same and memo[1] is cu_seqlens:   # this forward's, from an earlier layer
        return memo[2]
    if derived is pos:
        _not_recomputed_from_kept(given, ("position_ids",))
        full, lens = _global_positions(pos, group, world, context.ring_group)
        if context.ring_group is None:  # the heuristic knows the contiguous layout only
            _warn_local_positions(context, full, lens)
        result = lens, cu_seqlens if cu_seqlens is not None else cu_seqlens_from_position_ids(full), False
    else:
        result = _lengths_only(local_len, group, context.ring_group), cu_seqlens, False
    # Derived once per forward: every layer of it gets the same position ids (the same
    # tensor) or, without them, the same length; the memo holds the tensor, so its identity
    # cannot be reused by another forward's, and the model's hooks clear it at the next one.
    if context.depth > 0:
        context.forward_memo["lengths"] = (derived, cu_seqlens, result)
    return result


def token_mixer_call(module: nn.Module, local_len: int, kwargs: dict):
    """(context, every SP rank's length, global cu_seqlens or None) for one forward of a
    token mixer the package adapts (mixers.py), counted as a call of the package's token
    mixers (the guard's call check). Lengths and documents come as for the attention."""
    context = context_of(module) or require_default_context()
    context.attention_calls += 1
    lens, cu_seqlens, _ = lengths_and_documents(context, local_len, kwargs)
    return context, lens, cu_seqlens


def _not_recomputed_from_kept(given, used) -> None:
    """Inputs the attention takes from the model's forward (kept on the context, not passed
    down by the decoder layer) belong to the model's last forward: inside the backward, a
    recomputed layer (activation checkpointing) may be another forward's, so refuse."""
    kept = [key for key in used if key not in given]
    if kept and torch._C._current_graph_task_id() != -1:
        raise refusal(None, f"a decoder layer that does not pass {', '.join(kept)} down to its attention is "
                            "recomputed in the backward (activation checkpointing), where the documents of the "
                            "forward it recomputes are not known",
                      "Turn activation checkpointing off for this model, or pass the keyword arguments down.")


def _chunk_documents(context, cu_seqlens, total, chunk, query, where):
    """The chunks of a chunked layer as documents (chunked.py), derived once per forward."""
    key = ("chunks", chunk, total)
    memo = context.forward_memo.get(key)
    if memo is not None and memo[0] is cu_seqlens:
        return memo[1]
    chunks = chunked_cu_seqlens(cu_seqlens, total, chunk, query.device)
    if chunks is not None and query.shape[0] != 1:
        raise ValueError(f"{where}: chunked attention (attention_chunk_size {chunk}) over rows of {total} tokens "
                         f"needs batch size 1, got {query.shape[0]}: pack the rows into one (shard_batch with an "
                         "attention_mask unpads them into one packed row) or use rows of at most "
                         f"{chunk} tokens")
    context.forward_memo[key] = (cu_seqlens, chunks)
    return chunks
