"""The ``"ulysses"`` attention implementation for transformers: registration, the mask
function, packed-document boundaries from position ids, and the attention function that
calls `ulysses_kernels.ulysses_attention` on the sequence-parallel group (see the package
doc of `ulysses_kernels.hf` for the design notes)."""

from typing import Optional

import torch
from torch import nn

from ...api import ulysses_attention
from ...extensions import HF_INSTALL_HINT
from ...layout import head_plan_error
from ..context import (
    FORWARD_INPUTS,
    SequenceParallelContext,
    context_of,
    default_context,
    lengths_and_documents,
    require_default_context,
    set_default_context,
)
from ..families.attention.gemma3 import BLOCKS_KEY, block_attention
from ..families.attention.llama4 import (
    chunked_cu_seqlens,
    layer_chunk_size,
    positions_in_documents,
    retune_queries,
    tunes_temperature,
)
from ..families.vision.vision import is_local_attention, local_attention
from ..model import refusal
from .attach import ATTN_IMPLEMENTATION, meet_models_at_their_first_call
from .guard import refuse_in_own_attention_tables
from .heads import make_sequence_classification_exact, make_token_classification_exact
from .masks import ulysses_mask_function
from .patches import set_entry, undo_process_patches


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

    _register_in(AttentionInterface, name, ulysses_attention_forward)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:  # older transformers: no mask interface, masks reach the attention
        AttentionMaskInterface = None
    if AttentionMaskInterface is not None:
        _register_in(AttentionMaskInterface, name, ulysses_mask_function)
    refuse_in_own_attention_tables(name)
    make_sequence_classification_exact()
    make_token_classification_exact()
    meet_models_at_their_first_call()
    set_sequence_parallel_group(group, ring_group=ring_group, backend=backend)
    return name


def _register_in(interface, name: str, function) -> None:
    """`interface.register(name, function)` (transformers' process-wide table), recorded
    for unregister() unless it is there already."""
    if interface._global_mapping.get(name) is not function:
        set_entry(interface._global_mapping, name, function, f"transformers.{interface.__name__}[{name!r}]")


def unregister() -> None:
    """Undo what `register()` changed in transformers for the whole process (core/patches.py:
    the attention and mask functions, the refusing entries in the families' own attention
    tables, the exact generic heads, `PreTrainedModel.__call__`) and drop the default
    context: transformers then behaves as if the package had never been imported. Models
    built with ``attn_implementation="ulysses"`` no longer run (transformers no longer
    knows the name); `register()` again brings it back. Every rank calls it, after the
    models that use it are done."""
    undo_process_patches()
    set_default_context(None)


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


def tensor_parallel_heads_problem(module: nn.Module, q_heads: int, kv_heads: int, world: int) -> Optional[str]:
    """Why this rank's heads have no placement over the Ulysses group where tensor parallelism
    (the layer's weights are DTensors) gave the rank fewer query heads than the model has
    (None: they have, or no TP: `ulysses_attention` says why then). The same on every rank:
    TP splits the heads evenly."""
    from torch.distributed.tensor import DTensor

    config = getattr(module, "config", None)
    total = getattr(config, "num_attention_heads", None)
    if not isinstance(total, int) or q_heads >= total or not any(isinstance(p, DTensor) for p in module.parameters()):
        return None
    problem = head_plan_error(world, q_heads, kv_heads)
    if problem is None:
        return None
    return (f"{problem}: the model's {total} query heads are split by tensor parallelism first ({q_heads} on this "
            f"rank); the heads of a tensor-parallel rank (heads / TP size) must be divisible by the "
            f"sequence-parallel size {world}")


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

    split = tensor_parallel_heads_problem(module, query.shape[1], key.shape[1], context.ulysses()[1])
    if split:
        raise ValueError(f"{where}: {split}")
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
