"""The head-sharded KV cache of sequence-parallel inference (docs/architecture.md, "Around
the call"; the design is in generation.py's module doc).

After a Ulysses all-to-all every rank holds *its* heads for the *whole* sequence, which
is the layout decoding wants, so `HeadShardedCache` keeps exactly that and is never
reshuffled. Every model forward is a chunk of new tokens; a layer's attention is split
in two halves: `update` (transformers calls it with the chunk's K/V) and `attention`
(the "ulysses" attention function hands the queries to it, with the layer's attention
variants). Both run on the execution path the dispatch picks for the chunk's tensors
(distributed/dispatch.py): its exchange (the fused path's engine, or the torch all-to-all)
and its attention (the kernel choice on the Triton and fused paths).

What a layer caches is its business: the model's KV heads (split over the Ulysses ranks,
or replicated where there are fewer than ranks), or a one-head latent that the layer
expands into every head's keys and values itself (MLA, DeepSeek-V3: kept whole on every
rank, like a single KV head). A sliding-window layer keeps only the keys a later query
can still see: `attention` trims it after the chunk's attention, because only the
attention call knows the window (transformers calls `update` first).

This module needs transformers (the cache is a `DynamicCache`); generation.py imports it on
first use.
"""

import contextlib
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from transformers import DynamicCache

from ...api import path_for
from ...distributed.collectives import all_gather_tensor, broadcast_tensor
from ...distributed.groups import resolve_group
from ...layout import head_plan_error, place_heads
from ...ring.merge import accumulate_dtype, merge_partials, merge_sinks
from ...variants import make_variant
from ..context import SequenceParallelContext
from ..core.attach import model_context
from ..families.attention.llama4 import retune_queries, tunes_temperature


def head_counts(model) -> Optional[Tuple[int, int]]:
    """(query heads, KV heads) of a transformers model's (text) config; None for a model
    without attention (Mamba, RWKV, xLSTM: its config has no attention heads)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hq = getattr(config, "num_attention_heads", None)
    if hq is None:
        return None
    return int(hq), int(getattr(config, "num_key_value_heads", None) or hq)


def _context_for(model, ulysses_group, ring_group, backend):
    """Where `decoding()` points the attention: the model's context (attached the first
    time, as its first forward would), or, for a stand-in that is not a module, one on the
    given groups."""
    if isinstance(model, nn.Module):
        return model_context(model)
    return SequenceParallelContext(ulysses_group, ring_group=ring_group, backend=backend)


class PendingChunk(NamedTuple):
    """A layer's chunk K/V (this rank's heads, as cached), left by its `update` for its
    `attention`: transformers calls the cache's `update` first, then the attention function."""
    layer: int
    key: torch.Tensor
    value: torch.Tensor


class HeadShardedCache(DynamicCache):
    """One rank's KV cache: the KV heads it owns in its Ulysses group, for the tokens its
    ring rank holds (all of them without a ring; a sliding-window layer's last keys on
    every ring rank).

    ulysses_group / ring_group: this rank's groups (None: the default group / no ring);
    backend: the execution path to run on (None: automatic, distributed/dispatch.py).
    """

    def __init__(self, model, ulysses_group=None, ring_group=None, *, backend: Optional[str] = None, context=None):
        super().__init__()
        self.context = context if context is not None else _context_for(model, ulysses_group, ring_group, backend)
        self.ulysses = resolve_group(ulysses_group)
        self.ring = resolve_group(ring_group) if ring_group is not None else (None, 1, 0)
        # A model without attention holds no K/V (its token mixers keep `mixer_states`): no heads to place
        self.num_q_heads, self.num_kv_heads = head_counts(model) or (None, None)
        # raised by the first layer to exchange heads (`q_place`), the same on every rank: sparse
        # attentions whose queries stay on their shard (dsa.py, compressed.py) exchange none
        self._head_plan_error = None if self.num_q_heads is None else \
            head_plan_error(self.ulysses[1], self.num_q_heads, self.num_kv_heads)
        self.backend = backend
        self.path = None                     # the Path of this cache (the first attention's q/k/v decide)
        self.held = [0] * self.ring[1]       # tokens each ring rank holds (the same list on every rank)
        self.chunk_lens: Optional[List[int]] = None   # Ulysses shard lengths of a sharded chunk
        self._holder = 0                     # the ring rank that appends the chunk in progress
        self._pending: Optional[PendingChunk] = None   # `update`'s handoff to the same layer's `attention`
        self._holds_keys = True              # whether this rank attends to keys of that layer at all
        self._forward_tokens = 0             # tokens of the forward in progress (all ranks' shards)
        self._updated = set()                # layers whose `update` (or mixer state) ran in that forward
        self._entered = set()                # (layer, "attention" | "mixer") uses in that forward
        self.mixer_states = {}               # layer -> this rank's heads' conv history and recurrent state

    @property
    def q_place(self):
        """The query heads' placement over the Ulysses group (None: no attention)."""
        if self._head_plan_error:
            raise ValueError(f"HeadShardedCache: {self._head_plan_error}")
        return None if self.num_q_heads is None else place_heads(self.num_q_heads, self.ulysses[1])

    @property
    def _holds_chunk(self) -> bool:
        return self._holder == self.ring[2]

    # -- bookkeeping
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens layer `layer_idx` has seen, as transformers' own cache counts them: a
        layer whose `update` has not run yet in the forward in progress has not seen its
        tokens (Llama 4's temperature tuning reads this before the update)."""
        return sum(self.held) - (0 if layer_idx in self._updated else self._forward_tokens)

    @property
    def forward_start(self) -> int:
        """The global position of the first token of the forward in progress."""
        return sum(self.held) - self._forward_tokens

    def bytes_per_layer(self) -> List[int]:
        """Bytes of K/V this rank holds, per layer."""
        return [sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if isinstance(t, torch.Tensor)) for layer in self.layers]

    def bytes_per_rank(self) -> int:
        """Bytes of K/V this rank holds."""
        return sum(self.bytes_per_layer())

    def _own(self, place) -> slice:
        start = place.source_head(self.ulysses[2])
        return slice(start, start + place.local)

    def _path_for(self, tensors, *, keep: bool = True):
        """The cache's path: chosen by the first attention's q/k/v (`keep`). Before it, the
        first chunk's K/V choose its exchange only: what a layer caches need not be an
        attention input (an MLA latent's head dims may be ones no kernel takes)."""
        if self.path is not None:
            return self.path
        path = path_for(self.backend, tensors, distributed=self.ulysses[0] is not None)
        if keep:
            self.path = path
        return path

    @contextlib.contextmanager
    def sharded_chunk(self, lens: Optional[List[int]]):
        """Within: the forward in progress is a chunk split along the sequence over the Ulysses
        group, `lens` every rank's share (None: replicated, every rank holds it whole)."""
        self.chunk_lens = lens
        try:
            yield
        finally:
            self.chunk_lens = None

    @property
    def _sharded(self) -> bool:
        """The chunk in progress is split along the sequence over the Ulysses group."""
        return self.chunk_lens is not None

    def _exchange_args(self):
        group, _, rank = self.ulysses
        return dict(group=group, rank=rank, seq_lens=self.chunk_lens)

    # -- the first half: the chunk's K/V
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """K/V of the chunk `[B, H, T_local, D]` / `[B, H, T_local, Dv]` (H: the KV heads, or
        one latent head) -> this rank's held K/V `[B, H_own, S_held, D]` (with the chunk
        on the ring rank that holds it)."""
        self._enter_layer(layer_idx, key_states.shape[2], "attention")
        k, v = self._own_chunk(key_states, value_states, layer_idx)
        self._pending = PendingChunk(layer=layer_idx, key=k, value=v)
        if self._holds_chunk:
            self._holds_keys = True
            return super().update(k, v, layer_idx, *args, **kwargs)
        held = self._held(layer_idx)
        self._holds_keys = held is not None
        # No keys yet: the chunk's own K/V stand in, because models reshape what the cache
        # returns and an empty tensor breaks some (MLA's expansion); the attention knows.
        return held if held is not None else (k, v)

    def _enter_layer(self, layer_idx: int, local_len: int, kind: str) -> None:
        """Count layer `layer_idx`'s `kind` of cache use ("attention" or "mixer": Falcon-H1's
        layers have both) into the forward in progress. The first use of a forward (no use
        yet, or one this forward already made) starts a new chunk: the ring rank holding
        the fewest tokens takes it."""
        if not self._entered or (layer_idx, kind) in self._entered:
            total = sum(self.chunk_lens) if self._sharded else local_len
            self._holder = min(range(len(self.held)), key=lambda i: self.held[i])
            self.held[self._holder] += total
            self._forward_tokens, self._updated, self._entered = total, set(), set()
        self._entered.add((layer_idx, kind))
        self._updated.add(layer_idx)

    # -- the states of the adapted token mixers (hf/families/mixers.py)
    def mixer_state(self, layer_idx: int, local_len: int) -> dict:
        """The conv history and recurrent state of this rank's heads of token-mixer layer
        `layer_idx` (a dict the layer reads and replaces; empty before its first chunk),
        the layer counted into the forward in progress."""
        self._enter_layer(layer_idx, local_len, "mixer")
        return self.mixer_states.setdefault(layer_idx, {})

    def mixer_bytes(self) -> int:
        """Bytes of token-mixer state this rank holds."""
        return sum(t.numel() * t.element_size() for state in self.mixer_states.values() for t in state.values()
                   if isinstance(t, torch.Tensor))

    # -- a layer that attends by itself (hf/families/halo/inkling.py: a relative bias no kernel takes)
    def update_own_heads(self, key_states, value_states, layer_idx):
        """The chunk's K/V `[B, H, T_local, D]` (H: the layer's own KV heads, any count that
        has a placement) -> this rank's held K/V `[B, H_own, S, D]` with the chunk, for a layer
        that attends over them itself; its heads are `kv_heads_held(H)`. Without a ring, and a
        sliding window is the layer's to apply (every key is kept)."""
        self._enter_layer(layer_idx, key_states.shape[2], "attention")
        k, v = self._own_chunk(key_states, value_states, layer_idx, any_heads=True)
        return DynamicCache.update(self, k, v, layer_idx)

    def kv_heads_held(self, heads: int) -> range:
        """The heads of a `heads`-head tensor this rank holds (`update_own_heads`)."""
        start = place_heads(heads, self.ulysses[1]).source_head(self.ulysses[2])
        return range(start, start + place_heads(heads, self.ulysses[1]).local)

    def _own_chunk(self, key_states, value_states, layer_idx, *, any_heads: bool = False):
        """This rank's heads of the chunk's cached tensors, over the whole chunk: exchanged
        from the sequence shards (a sharded chunk) or sliced (a replicated one). The heads
        are placed like KV heads (`layout.place_heads`): split, or replicated where there are
        fewer than ranks, so a one-head latent lives whole on every rank. `any_heads`: the
        layer's own head count (`update_own_heads`), not only the model's."""
        heads = key_states.shape[1]
        if (not any_heads and heads not in (self.num_kv_heads, 1)) or value_states.shape[1] != heads:
            raise ValueError(f"HeadShardedCache: layer {layer_idx} caches keys of {heads} heads and values of "
                             f"{value_states.shape[1]}; the cache holds the model's {self.num_kv_heads} KV heads or "
                             f"a one-head latent (MLA)")
        if not self._sharded:
            own = self._own(place_heads(heads, self.ulysses[1]))
            return key_states[:, own], value_states[:, own]
        k, v = (x.transpose(1, 2).contiguous() for x in (key_states, value_states))
        path = self._path_for((k, k, v), keep=False)
        if k.shape[3] == v.shape[3]:
            k, v = path.seq_to_heads((k, v), **self._exchange_args())
        else:   # an exchange moves tensors of one head dim
            (k,), (v,) = (path.seq_to_heads((x,), **self._exchange_args()) for x in (k, v))
        return k.transpose(1, 2), v.transpose(1, 2)

    def _held(self, layer_idx):
        """What a ring rank that does not take the chunk attends to: its held K/V (None: none)."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            return layer.keys, layer.values
        return None

    # -- the second half: the chunk's queries
    def attention(self, query, key, value, scaling, causal, *, module=None, attention_chunk=None,
                  window_size=(-1, -1),
                  softcap=0.0, sinks=None):
        """query `[B, Hq, T_local, D]`, key/value `[B, Hk, S, D]` / `[B, Hk, S, Dv]` from `update`
        (or expanded from it by the layer) -> `[B, T_local, Hq, Dv]`. window_size / softcap:
        the layer's variants (docs/api.md, "Attention variants"); sinks: its `[Hq]` logits
        over the global heads; attention_chunk: the attention_chunk_size of a chunked layer (Llama 4,
        hf/families/attention/llama4.py); module: the attention module (Llama 4's temperature tuning)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise ValueError("HeadShardedCache: an attention call without its layer's cache update (layers that "
                             "share another layer's KV cache are not supported)")
        layer, chunk_kv = pending.layer, (pending.key, pending.value)
        variant = make_variant(window_size, softcap, causal=bool(causal))
        if module is not None and tunes_temperature(module):
            query = self._retune(module, query)
        keep = self._chunk_keep(attention_chunk) if attention_chunk is not None else None
        expanded = key.shape[1] != chunk_kv[0].shape[1] or key.shape[3] != chunk_kv[0].shape[3]
        q, path = self._own_queries(query, key, value)
        k, v = (x.transpose(1, 2) for x in self._own_keys(key, value, expanded))
        own_sinks = sinks[self._own(self.q_place)] if sinks is not None else None
        if variant.windowed or keep is not None:
            keep = variant.window[0] if keep is None else keep
            out = self._window_attention(path, q, k, v, causal, scaling, variant, own_sinks, layer, chunk_kv, keep)
        elif self.ring[1] == 1:
            out, _ = path.attention(q, k, v, causal=causal, softmax_scale=scaling, variant=variant, sinks=own_sinks)
        else:   # keys held elsewhere all precede the chunk: no mask there
            partial = self._partial(path, q, k, v, causal and self._holds_chunk, scaling, variant)
            out = self._merge_over_ring(*partial, own_sinks)
        return self._heads_to_output(path, out)

    def _own_queries(self, query, key, value):
        """This rank's query heads `[B, T, Hq_own, D]` over the whole chunk, and the path."""
        q = query.transpose(1, 2)
        path = self._path_for((q, key.transpose(1, 2), value.transpose(1, 2)))
        if self._sharded:
            return path.seq_to_heads((q.contiguous(),), **self._exchange_args())[0], path
        return q[:, :, self._own(self.q_place)], path

    def _own_keys(self, key, value, expanded):
        """Keys the layer expanded from its cache (MLA) carry every head of the model: take
        this rank's, placed like the heads of that count (they follow the query heads)."""
        if not expanded:
            return key, value
        heads = key.shape[1]
        if heads not in (self.num_q_heads, self.num_kv_heads):
            raise ValueError(f"HeadShardedCache: the layer attends to keys of {heads} heads, neither the model's "
                             f"{self.num_q_heads} query heads nor its {self.num_kv_heads} KV heads")
        own = self._own(place_heads(heads, self.ulysses[1]))
        return key[:, own], value[:, own]

    def _heads_to_output(self, path, out):
        """This rank's head outputs -> `[B, T_local, Hq, Dv]`: back to the sequence shard (a
        sharded chunk) or all-gathered over the heads (a replicated one)."""
        if self._sharded:
            return path.heads_to_seq(out.contiguous(), **self._exchange_args())
        return torch.cat(all_gather_tensor(out.contiguous(), self.ulysses[0]), dim=2)

    # -- sliding windows
    def _window_attention(self, path, q, k, v, causal, scale, variant, sinks, layer, chunk, keep):
        """A sliding-window layer lives whole on every ring rank: each appends every chunk
        (the window bounds it: W - 1 tokens per ring rank), so whichever takes the next
        chunk holds the window before it. Its keys are the newest, contiguous, so the
        kernels' bottom-right band is the window at the global positions. The ring rank
        holding the chunk attends and broadcasts the output over the ring (the others
        received their keys from `update` without the chunk, and an MLA layer has already
        expanded them); then every ring rank trims the layer to its last `keep` tokens.
        A chunked layer (Llama 4) is one too: its keys are the current chunk's, and it keeps
        the tokens of the chunk the next query is in (`_chunk_keep`)."""
        if self._holds_chunk:
            out, _ = path.attention(q, k, v, causal=causal, softmax_scale=scale, variant=variant, sinks=sinks)
        else:
            DynamicCache.update(self, *chunk, layer)   # the window's keys on every ring rank
            B, T, H, _ = q.shape
            out = q.new_empty(B, T, H, v.shape[3])
        if self.ring[1] > 1:
            out = broadcast_tensor(out, self._holder, self.ring[0])
        self._trim(layer, keep)
        return out

    def _chunk_keep(self, attention_chunk: int) -> int:
        """A chunked layer's tokens to keep after this forward: those of the chunk the next
        token is in. The forward must not cross a multiple of `chunk` (prefill cuts its
        forwards there; decoding runs one token at a time)."""
        start, end = self.forward_start, sum(self.held)
        if end > start and start // attention_chunk != (end - 1) // attention_chunk:
            raise ValueError(f"HeadShardedCache: a forward of tokens {start}..{end - 1} crosses a multiple of the "
                             f"attention_chunk_size {attention_chunk}; feed chunked-attention models forwards that "
                             "stay inside one chunk (ulysses_kernels.hf.prefill cuts them so)")
        return end % attention_chunk

    def _retune(self, module, query):
        """Llama 4's query temperature at the tokens' global positions (hf/families/attention/llama4.py):
        transformers counted from the forward's start on every rank of a sharded chunk."""
        start, T = self.forward_start, query.shape[2]
        offset = sum(self.chunk_lens[:self.ulysses[2]]) if self._sharded else 0
        assumed = torch.arange(start, start + T, device=query.device)
        return retune_queries(module, query, assumed, assumed + offset)

    def _trim(self, layer_idx, left: Optional[int]):
        """Keep the last `left` tokens of a layer whose band reaches `left` keys back: the
        next query, at position p >= the tokens so far L, sees keys p - left .. p, of which
        the held ones are L - left .. L - 1 at the most (HF's sliding_window W: W - 1).
        A copy, so the trimmed storage is freed."""
        layer = self.layers[layer_idx]
        if left is None or layer.keys.shape[2] <= left:
            return
        start = layer.keys.shape[2] - left
        layer.keys, layer.values = layer.keys[:, :, start:].clone(), layer.values[:, :, start:].clone()

    # -- the ring
    def _partial(self, path, q, k, v, causal, scale, variant):
        """(out, lse `[B, H, T]`) over this ring rank's keys, without the sinks; no keys:
        zeros and -inf."""
        B, T, H, _ = q.shape
        if not self._holds_keys:
            return q.new_zeros(B, T, H, v.shape[3]), torch.full((B, H, T), float("-inf"), device=q.device)
        return path.attention(q, k, v, causal=causal, softmax_scale=scale, with_lse=True, variant=variant)

    def _merge_over_ring(self, out, lse, sinks):
        """The merge of every ring rank's partial attention (ring/merge.py): identical on
        every ring rank (the same gathered lists, the same arithmetic). The sinks join
        once, after every key: a sink in each partial would count R times."""
        acc = accumulate_dtype(out.dtype)
        outs = all_gather_tensor(out.to(acc), self.ring[0])
        lses = all_gather_tensor(lse.to(acc), self.ring[0])
        merged, merged_lse = merge_partials(outs, lses)
        if sinks is not None:
            merged, _ = merge_sinks(merged, merged_lse, sinks)
        return merged.to(out.dtype)


_WITH_OWN_CACHE: Dict[type, type] = {}


def head_sharded_cache_class(own: Optional[type]) -> type:
    """`HeadShardedCache`, or, for a model whose forward insists on a cache class of its own
    (families/adapters.py's `own_cache_class`: MiniMax), a subclass of both (made once per
    class): the model takes it, and what it reads of it is the head-sharded cache's."""
    if own is None or issubclass(HeadShardedCache, own):
        return HeadShardedCache
    made = _WITH_OWN_CACHE.get(own)
    if made is None:
        made = _WITH_OWN_CACHE[own] = type(f"HeadSharded{own.__name__}", (HeadShardedCache, own), {})
    return made
