"""The head-sharded KV cache of sequence-parallel inference (docs/architecture.md, "Around
the call"; the design is in generation.py's module doc).

After a Ulysses all-to-all every rank holds *its* heads for the *whole* sequence, which
is the layout decoding wants, so `HeadShardedCache` keeps exactly that and is never
reshuffled. Every model forward is a chunk of new tokens; a layer's attention is split
in two halves: `update` (transformers calls it with the chunk's K/V) and `attention`
(the "ulysses" attention function hands the queries to it). Both run on the execution
path the dispatch picks for the chunk's tensors (distributed/dispatch.py): its exchange (the
fused path's engine, or the torch all-to-all) and its attention (the kernel choice on
the Triton and fused paths).

This module needs transformers (the cache is a `DynamicCache`); generation.py imports it on
first use.
"""

from typing import List, Optional, Tuple

import torch
from transformers import DynamicCache

from ..api import path_for
from ..distributed.collectives import all_gather_tensor
from ..distributed.groups import resolve_group
from ..layout import head_plan_error, place_heads
from ..ring.merge import accumulate_dtype, merge_partials


def head_counts(model) -> Tuple[int, int]:
    """(query heads, KV heads) of a transformers model's (text) config."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hq = int(config.num_attention_heads)
    return hq, int(getattr(config, "num_key_value_heads", None) or hq)


class HeadShardedCache(DynamicCache):
    """One rank's KV cache: the KV heads it owns in its Ulysses group, for the tokens its
    ring rank holds (all of them without a ring).

    ulysses_group / ring_group: this rank's groups (None: the default group / no ring);
    backend: the execution path to run on (None: automatic, distributed/dispatch.py).
    """

    def __init__(self, model, ulysses_group=None, ring_group=None, *, backend: Optional[str] = None):
        super().__init__()
        self.ulysses = resolve_group(ulysses_group)
        self.ring = resolve_group(ring_group) if ring_group is not None else (None, 1, 0)
        self.num_q_heads, self.num_kv_heads = head_counts(model)
        err = head_plan_error(self.ulysses[1], self.num_q_heads, self.num_kv_heads)
        if err:
            raise ValueError(f"HeadShardedCache: {err}")
        self.q_place = place_heads(self.num_q_heads, self.ulysses[1])
        self.kv_place = place_heads(self.num_kv_heads, self.ulysses[1])
        self.backend = backend
        self.path = None                     # the Path of this cache's chunks (the first chunk's tensors decide)
        self.held = [0] * self.ring[1]       # tokens each ring rank holds (the same list on every rank)
        self.chunk_lens: Optional[List[int]] = None   # Ulysses shard lengths of a sharded chunk
        self._holds_chunk = True

    # -- bookkeeping
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return sum(self.held)

    def bytes_per_rank(self) -> int:
        """Bytes of K/V this rank holds."""
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor))

    def _own(self, place) -> slice:
        start = place.source_head(self.ulysses[2])
        return slice(start, start + place.local)

    def _path_for(self, tensors):
        if self.path is None:
            self.path = path_for(self.backend, tensors, distributed=self.ulysses[0] is not None)
        return self.path

    def _exchange_args(self):
        group, _, rank = self.ulysses
        return dict(group=group, rank=rank, seq_lens=self.chunk_lens)

    # -- the two halves of a layer's attention
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """K/V of the chunk `[B, Hkv, T_local, D]` -> this rank's held K/V `[B, Hkv_own, S_held, D]`."""
        sharded = self.chunk_lens is not None
        if layer_idx == 0:   # a new chunk: the ring rank holding the fewest tokens takes it
            total = sum(self.chunk_lens) if sharded else key_states.shape[2]
            holder = min(range(len(self.held)), key=lambda i: self.held[i])
            self.held[holder] += total
            self._holds_chunk = holder == self.ring[2]
        if sharded:
            k, v = (x.transpose(1, 2).contiguous() for x in (key_states, value_states))
            path = self._path_for((k, k, v))
            k, v = path.seq_to_heads((k, v), **self._exchange_args())
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            own = self._own(self.kv_place)
            k, v = key_states[:, own], value_states[:, own]
        if self._holds_chunk:
            return super().update(k, v, layer_idx, *args, **kwargs)
        if layer_idx < len(self.layers) and getattr(self.layers[layer_idx], "keys", None) is not None \
                and self.layers[layer_idx].keys.numel():
            return self.layers[layer_idx].keys, self.layers[layer_idx].values
        return k[:, :, :0], v[:, :, :0]

    def attention(self, query, key, value, scaling, causal):
        """query `[B, Hq, T_local, D]`, key/value from `update` -> `[B, T_local, Hq, D]`."""
        _, world, _ = self.ulysses
        q = query.transpose(1, 2)
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        path = self._path_for((q, k, v))
        sharded = self.chunk_lens is not None and world > 1
        if sharded:
            q = path.seq_to_heads((q.contiguous(),), **self._exchange_args())[0]
        else:
            q = q[:, :, self._own(self.q_place)]
        causal = causal and self._holds_chunk   # keys held elsewhere all precede the chunk
        if self.ring[1] == 1:
            out, _ = path.attention(q, k, v, causal=causal, softmax_scale=scaling)
        else:
            out = self._merge_over_ring(*self._partial(path, q, k, v, causal, scaling))
        if sharded:
            return path.heads_to_seq(out.contiguous(), **self._exchange_args())
        return torch.cat(all_gather_tensor(out.contiguous(), self.ulysses[0]), dim=2)

    def _partial(self, path, q, k, v, causal, scale):
        """(out, lse `[B, H, T]`) over this ring rank's keys; no keys: zeros and -inf."""
        B, T, H, _ = q.shape
        if k.shape[1] == 0:
            return torch.zeros_like(q), torch.full((B, H, T), float("-inf"), device=q.device)
        return path.attention(q, k, v, causal=causal, softmax_scale=scale, with_lse=True)

    def _merge_over_ring(self, out, lse):
        """The merge of every ring rank's partial attention (ring/merge.py): identical on
        every ring rank (the same gathered lists, the same arithmetic)."""
        acc = accumulate_dtype(out.dtype)
        outs = all_gather_tensor(out.to(acc), self.ring[0])
        lses = all_gather_tensor(lse.to(acc), self.ring[0])
        return merge_partials(outs, lses)[0].to(out.dtype)
