"""Llama 4's attention features under sequence parallelism (docs/hf_families.md, "Chunked attention (Llama 4)").

**Chunked attention.** A layer of kind ``"chunked_attention"`` (config.layer_types) lets a
query see the keys of its own chunk only: chunks of ``config.attention_chunk_size`` = C
tokens from the start of the sequence. Chunks are documents of fixed length, so they
compose with packed documents: each document is cut into chunks from its own start (what
each document run on its own gives), and the attention gets the refined `cu_seqlens`.

**Temperature tuning.** Llama 4 scales the queries of its NoPE layers by a factor of the
token's position, ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, with p taken
from local indices (``arange(S) + tokens cached``), not from position ids: on a sequence
shard every rank would count from 0. `retune_queries` replaces HF's factor by the one of
each token's true position (its index inside its document); factors that agree (every
position below ``floor_scale - 1``) leave the queries untouched.
"""

from typing import List, Optional

import torch


def layer_chunk_size(module) -> Optional[int]:
    """C for an attention module of a ``"chunked_attention"`` layer, else None."""
    config = getattr(module, "config", None)
    index = getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and index is not None and isinstance(kinds, (list, tuple)) and index < len(kinds) \
            and kinds[index] == "chunked_attention":
        return int(chunk)
    return None


def chunk_bounds(bounds: List[int], chunk: int) -> List[int]:
    """Document boundaries `[0, ..., S]` with every document cut into chunks of `chunk`
    tokens from its own start."""
    out = [bounds[0]]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        out.extend(range(start + chunk, stop, chunk))
        out.append(stop)
    return out


def chunked_cu_seqlens(cu_seqlens: Optional[torch.Tensor], total: int, chunk: int,
                       device) -> Optional[torch.Tensor]:
    """The int32 `cu_seqlens` of the chunks (None: one document no longer than a chunk)."""
    bounds = [int(b) for b in cu_seqlens.tolist()] if cu_seqlens is not None else [0, total]
    cut = chunk_bounds(bounds, chunk)
    if len(cut) == 2:
        return None
    return torch.tensor(cut, dtype=torch.int32, device=device)


def tunes_temperature(module) -> bool:
    """The module scales its queries by position (Llama 4's NoPE layers)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def temperature(module, positions: torch.Tensor) -> torch.Tensor:
    """Llama 4's query factor at `positions` (float32, as transformers computes it)."""
    p = positions.float()
    return torch.log1p(torch.floor((p + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def retune_queries(module, query: torch.Tensor, assumed: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """query `[B, H, S, D]` scaled by transformers at positions `assumed` `[S]` -> scaled
    at positions `true` `[S]` (see the module doc); unchanged where the factors agree."""
    have, want = temperature(module, assumed), temperature(module, true)
    differs = have != want
    if not bool(differs.any()):
        return query
    # In the precision transformers multiplied in (the float32 factor promotes bf16 queries).
    dtype = torch.promote_types(query.dtype, torch.float32)
    shape = (1, 1, -1, 1)
    fixed = query.to(dtype) / have.to(dtype).view(shape) * want.to(dtype).view(shape)
    return torch.where(differs.view(shape), fixed.to(query.dtype), query)


def positions_in_documents(token_ranges, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """This rank's tokens' indices inside their documents `[S_local]`, from the global
    (start, length) ranges it holds and the document boundaries."""
    index = torch.cat([torch.arange(start, start + n, device=device) for start, n in token_ranges]) \
        if token_ranges else torch.zeros(0, dtype=torch.long, device=device)
    if cu_seqlens is None:
        return index
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    doc = torch.searchsorted(bounds, index, right=True) - 1
    return index - bounds[doc]
