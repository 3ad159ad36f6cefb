"""The ``"ulysses"`` attention implementation for transformers: registration, the mask
function, packed-document boundaries from position ids, and the attention function that
calls `ulysses_kernels.ulysses_attention` on the sequence-parallel group (see the package
doc of `ulysses_kernels.hf` for the design notes)."""

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..api import gather_sequence, ulysses_attention
from ..distributed.collectives import any_rank, gather_ints
from ..distributed.groups import collective_device, resolve_group
from ..layout import split_lengths
from ..ring.layout import sp_lengths
from .batch import cu_seqlens_from_position_ids, split_groups

ATTN_IMPLEMENTATION = "ulysses"


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError("ulysses_kernels.hf needs Hugging Face transformers: "
                          "pip install 'ulysses-kernels[hf]' (or 'transformers>=5.24')") from exc
    return transformers


# ----------------------------------------------------------------------------- state

class _State:
    group = None          # the SP process group (None: default group / single process);
                          # with a ring, this rank's Ulysses group
    ring_group = None     # the ring group of the Ulysses x Ring hybrid (None: pure Ulysses)
    group_set = False     # set_sequence_parallel_group was called
    backend: Optional[str] = None
    warned_local_positions = False
    inference_cache = None   # the HeadShardedCache of a prefill/decode in progress (generation.decoding)


_STATE = _State()


def set_sequence_parallel_group(group, *, ring_group=None, backend: Optional[str] = None) -> None:
    """Set the SP process group (and optionally the `ulysses_attention` backend) that the
    ``"ulysses"`` attention implementation uses. `group=None` means the default group.

    Ulysses x Ring: pass the Ulysses group and `ring_group`, or simply the `ParallelGroups`
    returned by `init_sequence_parallel(sp, ring_size=R)`."""
    _STATE.group, _STATE.ring_group = split_groups(group, ring_group)
    _STATE.group_set = True
    _STATE.backend = backend


def get_sequence_parallel_group():
    """The SP group set by `set_sequence_parallel_group` / `register` (None = default)."""
    return _STATE.group


def get_attention_backend() -> Optional[str]:
    """The backend set by `set_sequence_parallel_group` / `register` (None: automatic)."""
    return _STATE.backend


def _sp_group():
    """(group, world, rank) for the attention; refuses to guess in a multi-rank world."""
    if not _STATE.group_set and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        raise ValueError("ulysses attention: no sequence-parallel group set; call "
                         "ulysses_kernels.hf.register(sp_group) or set_sequence_parallel_group(sp_group) "
                         "(pass None explicitly to use the whole world)")
    return resolve_group(_STATE.group)


def register(group=None, *, ring_group=None, backend: Optional[str] = None, name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the ``"ulysses"`` attention (and its mask function) with transformers and
    set the SP group. Returns the implementation name to pass as `attn_implementation`
    (to `from_pretrained`/`from_config`, or `model.set_attn_implementation(name)`).

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
    set_sequence_parallel_group(group, ring_group=ring_group, backend=backend)
    return name


# ----------------------------------------------------------------------------- masks

def _padding_problem(attention_mask) -> Optional[str]:
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        return f"a {type(attention_mask).__name__} attention mask is not supported"
    if attention_mask.dim() != 2:
        return f"a custom {attention_mask.dim()}-D attention mask is not supported"
    if not bool(attention_mask.bool().all()):
        return "a padding attention_mask (with zeros) is not supported"
    return None


def ulysses_mask_function(*args, attention_mask=None, **kwargs):
    """Mask function registered in `AttentionMaskInterface` for ``"ulysses"``.

    Builds nothing (returns None): the attention is causal by flag and packed documents
    come from the position ids. A 2-D padding mask with zeros raises on every rank of the
    SP group (the ranks agree via one small all-reduce per call, so nobody hangs).
    """
    problem = _padding_problem(attention_mask)
    group, _, _ = _sp_group()
    found = any_rank(problem is not None, group)
    if _STATE.ring_group is not None:  # a ring group meets every Ulysses group: the OR over the grid
        found = any_rank(found, resolve_group(_STATE.ring_group)[0])
    if found:
        problem = problem or "another rank of the sequence-parallel group got an unsupported attention_mask"
    if problem:
        raise ValueError(f"ulysses attention: {problem}. Sequence-parallel training expects "
                         "unpadded (optionally packed) batches: pass the padding mask to "
                         "shard_batch(..., attention_mask=mask), which unpads the batch, and call the model "
                         "with batch.model_inputs() (no attention_mask).")
    return None


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


def _warn_local_positions(pos, lens):
    if _STATE.warned_local_positions or len(lens) <= 1:
        return
    starts, s = [], 0
    for n in lens:
        starts.append(s)
        s += n
    row = pos[0]
    if all(n > 0 for n in lens) and all(int(row[st]) == 0 for st in starts) and \
            bool(((row[1:] - row[:-1]) != 1).sum() == len(lens) - 1):
        _STATE.warned_local_positions = True
        warnings.warn("ulysses attention: every rank's position_ids start at 0 exactly at the shard "
                      "boundaries; if the model was called without global position_ids, RoPE and the "
                      "document boundaries are wrong. Use ulysses_kernels.hf.shard_batch (it passes "
                      "global position ids).", RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------------ attention

_UNSUPPORTED_KW = {
    "position_bias": "an additive position bias",
}


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
    """transformers attention function (``AttentionInterface``) running Ulysses attention.

    query `[B, Hq, S_local, D]`, key `[B, Hkv, S_local, D]`, value `[B, Hkv, S_local, Dv]`
    (transformers' layout) -> (`[B, S_local, Hq, Dv]`, None), like `sdpa_attention_forward`;
    sliding windows, softcap and sinks from the layer's arguments (`layer_variants`).
    """
    where = f"ulysses attention ({type(module).__name__})"
    if attention_mask is not None:
        raise ValueError(f"{where}: got an attention mask of shape {tuple(attention_mask.shape)}; "
                         "custom/padding masks cannot be honoured. Pass unpadded (packed) batches and "
                         "let position_ids mark documents (see ulysses_kernels.hf.shard_batch).")
    if dropout and dropout > 0.0:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported (set "
                         "config.attention_dropout = 0.0)")
    for kw, what in _UNSUPPORTED_KW.items():
        if kwargs.get(kw) is not None:
            raise ValueError(f"{where}: {what} ({kw}) is not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    variants = layer_variants(module, kwargs, bool(causal))
    if _STATE.inference_cache is not None:   # hf.prefill / hf.generate: a chunk over the KV cache
        return _STATE.inference_cache.attention(query, key, value, scaling, causal, **variants), None
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{where}: query length {query.shape[2]} != key length {key.shape[2]} "
                         "(a KV cache / generation?): train with use_cache=False, generate with "
                         "ulysses_kernels.hf.generate / prefill")
    group, world, _ = _sp_group()

    seq_lens = kwargs.get("ulysses_seq_lens")
    cu_seqlens = kwargs.get("ulysses_cu_seqlens")
    if seq_lens is not None:
        lens = [int(n) for n in seq_lens]
        trusted = True
    else:
        trusted = False
        pos = kwargs.get("position_ids")
        if pos is not None and isinstance(pos, torch.Tensor):
            full, lens = _global_positions(pos, group, world, _STATE.ring_group)
            if _STATE.ring_group is None:  # the heuristic knows the contiguous layout only
                _warn_local_positions(full, lens)
            if cu_seqlens is None:
                cu_seqlens = cu_seqlens_from_position_ids(full)
        else:
            lens = _lengths_only(query.shape[2], group, _STATE.ring_group)
    if cu_seqlens is not None and query.shape[0] != 1:
        raise ValueError(f"{where}: packed documents need batch size 1, got {query.shape[0]}")

    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    out = ulysses_attention(q, k, v, group=group, causal=bool(causal), softmax_scale=scaling,
                            seq_lens=lens if trusted else None, cu_seqlens=cu_seqlens,
                            backend=_STATE.backend, ring_group=_STATE.ring_group, **variants)
    return out, None

