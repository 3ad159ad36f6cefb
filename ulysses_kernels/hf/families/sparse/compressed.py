"""DeepSeek-V4's attention (`deepseek_v4`: a sliding window, and compressed entries selected by
an indexer (CSA) or all of them (HCA)) under sequence parallelism, in training and generation: the queries stay
on their sequence shard, what every head reads of a token is gathered (docs/hf_families.md,
"Sparse attention: DeepSeek-V4"; the selection rule: selection.py).

One layer, as transformers 5.25 computes it (`DeepseekV4Attention` with its compressors): MQA
with one head of `head_dim` that is both key and value (RMS-normed, rope on its trailing
channels), queries through a low-rank `q_residual`, a sink logit a head, and the output's rope
undone before a grouped low-rank output projection. A query sees the last `sliding_window`
tokens, and compressed entries: a CSA layer's compressor pools each window of `m` tokens (and
the previous window's other half, softmax-gated with a position bias) into one entry turned by
the rope of its first token, and its indexer (the same pooling of its own projections at
`index_head_dim`) scores them `sum_h w_h relu(q_h . e) / sqrt(d)` in float32 and keeps the
`index_topk` best; an HCA layer pools windows of `m'` tokens and keeps every entry. Entry `w`
is visible to the query at position `t` once its window has closed, `w < (t + 1) // m`.
transformers anchors the windows at the row's first slot; here at each document's first token,
as when each document runs alone.

Sequence-parallel: every rank gathers the key-value head of every token (differentiable: the
backward sums each token's gradient on its owner) and the compressors' projections (the
indexer's without gradient), pools every document's entries itself, selects for its own
queries (selection.py's rule over `KEY_TILE` entries at a time) and attends, `QUERY_TILE`
queries at a time (recomputed in the backward), over each query's window rows and its entries:
no head exchange. Not on a ring (refused on every rank).

Generation (`ulysses_kernels.hf.generate` / `prefill`): every rank keeps the same decoding state
a layer (`_generation_keys`): the last `sliding_window - 1` key-value rows, the entries so far
and the projections of the windows not yet closed (and, for CSA's overlap, the one before); a
chunk's rows and projections are gathered from its shards and join them.
"""

import sys
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from ....api import gather_sequence
from ....exchange.sequence import all_gather_sequence
from ..family import SPARSE_ATTENTION, Adapter, Family
from ..mixers import document_starts
from .selection import EMPTY, tiled_select

V4_CLASSES = ("DeepseekV4Attention",)
KEY_TILE = 4096     # entries the indexer scores at once
QUERY_TILE = 256    # queries attending at once (recomputed in the backward)


def _rope(module):
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


class Entries(NamedTuple):
    """The compressed entries of every document of the sequence: `values` `[B, E, D]`, each
    one's document start `starts` `[E]` (a global token index) and window `windows` `[E]`
    (counted from its document's start), windows of `ratio` tokens."""
    values: torch.Tensor
    starts: torch.Tensor
    windows: torch.Tensor
    ratio: int

    def visible(self, queries, query_starts) -> torch.Tensor:
        """`[n, E]`: which entries the queries at global indices `queries` (their documents'
        starts `query_starts`) see: their document's, once the window has closed."""
        closed = (queries - query_starts + 1) // self.ratio
        return (self.starts[None, :] == query_starts[:, None]) & (self.windows[None, :] < closed[:, None])


def _pooled(compressor, kv, gate, overlap: bool, head_dim: int):
    """One document's entries before rope `[B, windows, head_dim]`, from its tokens' projections
    `kv` / `gate` `[B, n, C]` (C = 2 x head_dim with the overlap of the previous window's first
    half, CSA; head_dim without, HCA), as transformers pools them without a cache."""
    B, n, _ = kv.shape
    ratio = compressor.compress_rate
    windows = n // ratio
    chunk_kv = kv[:, :windows * ratio].view(B, windows, ratio, -1)
    chunk_gate = gate[:, :windows * ratio].view(B, windows, ratio, -1) + compressor.position_bias
    if overlap:
        new_kv = chunk_kv.new_zeros((B, windows, 2 * ratio, head_dim))
        new_gate = chunk_gate.new_full((B, windows, 2 * ratio, head_dim), float("-inf"))
        new_kv[:, :, ratio:] = chunk_kv[..., head_dim:]
        new_gate[:, :, ratio:] = chunk_gate[..., head_dim:]
        if windows > 1:
            new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, :head_dim]
            new_gate[:, 1:, :ratio] = chunk_gate[:, :-1, :, :head_dim]
        chunk_kv, chunk_gate = new_kv, new_gate
    return compressor.kv_norm((chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(2))


def _entries(compressor, kv, gate, doc_bounds, overlap: bool, head_dim: int) -> Entries:
    """Every document's entries (`doc_bounds`: its first and past-last global token), each
    turned by the compress rope of its window's first token from the document's start."""
    values, starts, windows = [], [], []
    ratio = compressor.compress_rate
    for start, stop in doc_bounds:
        count = (stop - start) // ratio
        if count == 0:
            continue
        pooled = _pooled(compressor, kv[:, start:stop], gate[:, start:stop], overlap, head_dim)
        positions = (torch.arange(count, device=kv.device) * ratio)[None].expand(kv.shape[0], -1)
        cos, sin = compressor.rotary_emb(pooled, position_ids=positions, layer_type=compressor.rope_layer_type)
        values.append(_rope(compressor)(pooled.unsqueeze(1), cos, sin).squeeze(1))
        starts.append(torch.full((count,), start, device=kv.device, dtype=torch.long))
        windows.append(torch.arange(count, device=kv.device))
    if not values:
        empty = torch.zeros(0, dtype=torch.long, device=kv.device)
        return Entries(kv.new_zeros((kv.shape[0], 0, head_dim)), empty, empty, ratio)
    return Entries(torch.cat(values, dim=1), torch.cat(starts), torch.cat(windows), ratio)


def _doc_bounds(starts, total: int):
    firsts = torch.unique(starts).tolist()
    return list(zip(firsts, firsts[1:] + [total]))


@torch.no_grad()
def _select(indexer, hidden_states, q_residual, position_ids, entries: Entries, queries, query_starts):
    """`[B, n, k]` long: the entries each local query keeps (selection.py's rule over the
    indexer's float32 scores, `KEY_TILE` entries at a time), EMPTY-padded."""
    B, n, _ = hidden_states.shape
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(B, n, -1, indexer.head_dim).transpose(1, 2)
    q = _rope(indexer)(q, cos, sin).transpose(1, 2).float()                        # [B, n, heads, d]
    scorer = indexer.scorer
    weights = scorer.weights_proj(hidden_states).float() * scorer.weights_scaling  # [B, n, heads]
    chosen = []
    for first_query in range(0, n, QUERY_TILE):
        part = slice(first_query, first_query + QUERY_TILE)

        def tile(first, stop, part=part):
            keys = entries.values[:, first:stop].float()
            scores = torch.relu(torch.einsum("bqhd,bed->bqhe", q[:, part], keys)) * scorer.softmax_scale
            scores = (scores * weights[:, part, :, None]).sum(dim=2)
            visible = entries.visible(queries[part], query_starts[part])[:, first:stop]
            return scores.masked_fill(~visible, float("-inf"))
        chosen.append(tiled_select(tile, entries.values.shape[1], indexer.index_topk, KEY_TILE)[1].long())
    return torch.cat(chosen, dim=1)


def _rows(x, index):
    """`x` `[B, T, C]` at `index` `[B, n, k]` (EMPTY: any row, masked by the caller): `[B, n,
    k, C]`; the backward scatters into `[B, T, C]`."""
    B, n, k = index.shape
    flat = index.clamp(min=0).reshape(B, n * k, 1).expand(B, n * k, x.shape[-1])
    return x.gather(1, flat).view(B, n, k, x.shape[-1])


def _attend_tile(q, kv, window, entries, chosen, queries, query_starts, sinks, scaling: float):
    """Queries `[B, H, n, D]` (at global indices `queries`, their documents' starts
    `query_starts`) over their window rows (`window` `[B, n, W]` of the gathered key-value
    heads `kv` `[B, T, D]`, EMPTY: none) and their entries: `chosen` `[B, n, k]` of `entries`
    (CSA), or every one they see (HCA: `chosen` None; their scores `[B, H, n, E]`, the mask
    made here, not kept for the backward); a sink logit a head, float32 as transformers keeps
    it. The softmax in float32 or wider: `[B, H, n, D]`."""
    rows = _rows(kv, window)
    scores = torch.einsum("bhqd,bqkd->bhqk", q, rows) * scaling
    parts = [scores.masked_fill((window < 0)[:, None], float("-inf"))]
    if entries is not None and chosen is not None:
        entry_rows = _rows(entries.values, chosen)
        entry_scores = torch.einsum("bhqd,bqkd->bhqk", q, entry_rows) * scaling
        parts.append(entry_scores.masked_fill((chosen < 0)[:, None], float("-inf")))
    elif entries is not None:
        entry_scores = torch.einsum("bhqd,bed->bhqe", q, entries.values) * scaling
        parts.append(entry_scores.masked_fill(~entries.visible(queries, query_starts)[None, None], float("-inf")))
    B, H, n, _ = q.shape
    parts.append(sinks.view(1, H, 1, 1).expand(B, H, n, 1))   # torch.cat promotes as transformers' does
    logits = torch.cat(parts, dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)).to(q.dtype)
    W = window.shape[-1]
    out = torch.einsum("bhqk,bqkd->bhqd", probs[..., :W], rows)
    if entries is not None and chosen is not None:
        out = out + torch.einsum("bhqk,bqkd->bhqd", probs[..., W:-1], entry_rows)
    elif entries is not None:
        out = out + torch.einsum("bhqe,bed->bhqd", probs[..., W:-1], entries.values)
    return out


def _window(queries, query_starts, size: int):
    """`[n, size]`: each query's window, its last `size` tokens of its document (EMPTY before
    the document's start)."""
    rows = queries[:, None] - torch.arange(size - 1, -1, -1, device=queries.device)[None, :]
    return rows.masked_fill(rows < query_starts[:, None], EMPTY)


def _entry_choice(module, hidden_states, q_residual, position_ids, index_entries, queries, query_starts):
    """The entries each local query keeps `[B, n, k]` (EMPTY-padded): the indexer's choice over
    `index_entries` (CSA); None for an HCA layer (every entry it sees) or a sliding one."""
    if module.layer_type != "compressed_sparse_attention":
        return None
    if index_entries.values.shape[1] == 0:   # no window closed yet
        return queries.new_full((hidden_states.shape[0], queries.shape[0], module.compressor.indexer.index_topk),
                                EMPTY)
    return _select(module.compressor.indexer, hidden_states, q_residual, position_ids, index_entries, queries,
                   query_starts)


def _gathered_entries(module, hidden_states, group, lens, bounds):
    """The layer's compressed entries over the whole sequence (None: a sliding layer): its
    compressor's projections gathered (with a backward), pooled per document."""
    compressor = module.compressor
    if compressor is None:
        return None
    overlap = module.layer_type == "compressed_sparse_attention"
    projected = torch.cat([compressor.kv_proj(hidden_states), compressor.gate_proj(hidden_states)], dim=-1)
    kv, gate = gather_sequence(projected, group, dim=1, seq_lens=lens).chunk(2, dim=-1)
    return _entries(compressor, kv, gate, bounds, overlap, compressor.head_dim)


def _gathered_index_entries(module, hidden_states, group, lens, bounds):
    """The CSA indexer's entries over the whole sequence (no gradient: it only selects)."""
    indexer = module.compressor.indexer
    with torch.no_grad():
        projected = torch.cat([indexer.kv_proj(hidden_states), indexer.gate_proj(hidden_states)], dim=-1)
        kv, gate = all_gather_sequence(projected, lens, 1, group).chunk(2, dim=-1)
        return _entries(indexer, kv, gate, bounds, True, indexer.head_dim)


class Keys(NamedTuple):
    """What this rank's queries attend over: the key-value head of tokens `first..` `[B, T, D]`,
    the entries (None: a sliding layer) and the indexer's (CSA; else None), the queries' global
    indices `[n]` and their documents' starts `[n]`."""
    kv: torch.Tensor
    first: int
    entries: object
    index_entries: object
    queries: torch.Tensor
    query_starts: torch.Tensor


def _training_keys(module, hidden_states, kv, call) -> Keys:
    """The keys of a forward over the sequence (`call`: family.MixerCall): gathered over the
    whole sequence, entries pooled per document (`kv`: this rank's key-value head `[B, S_local,
    D]`)."""
    lens, cu_seqlens, group, rank = call.lens, call.cu_seqlens, call.group, call.context.ulysses()[2]
    total = sum(lens)
    starts = document_starts(cu_seqlens, total, hidden_states.device)
    if starts is None:
        starts = torch.zeros(total, dtype=torch.long, device=hidden_states.device)
    bounds = _doc_bounds(starts, total)
    queries = torch.arange(sum(lens[:rank]), sum(lens[:rank + 1]), device=hidden_states.device)
    index_entries = _gathered_index_entries(module, hidden_states, group, lens, bounds) \
        if module.layer_type == "compressed_sparse_attention" else None
    return Keys(gather_sequence(kv, group, dim=1, seq_lens=lens), 0,
                _gathered_entries(module, hidden_states, group, lens, bounds), index_entries, queries, starts[queries])


def _grown(state: dict, name: str, compressor, projected, first: int, overlap: bool, head_dim: int) -> Entries:
    """Generation: the entries of `state`'s `name` grown by the windows the chunk closes
    (`projected`: the chunk's `[kv | gate]` projections on every rank, its first token
    `first`); the state keeps the entries and the projections a later window still reads (its
    own, and with `overlap` the window before)."""
    ratio = compressor.compress_rate
    tail, tail_first = state.get(f"{name} tail"), state.get(f"{name} tail first", first)
    projected = projected if tail is None else torch.cat([tail, projected], dim=1)
    done, now = state.get(f"{name} windows", 0), (tail_first + projected.shape[1]) // ratio
    values = state.get(f"{name} entries")
    if now > done:
        since = max(done - 1, 0) if overlap else done   # the window before reads as the overlap, then is dropped
        kv, gate = projected[:, since * ratio - tail_first:now * ratio - tail_first].chunk(2, dim=-1)
        pooled = _pooled(compressor, kv, gate, overlap, head_dim)[:, done - since:]
        positions = (torch.arange(done, now, device=kv.device) * ratio)[None].expand(kv.shape[0], -1)
        cos, sin = compressor.rotary_emb(pooled, position_ids=positions, layer_type=compressor.rope_layer_type)
        pooled = _rope(compressor)(pooled.unsqueeze(1), cos, sin).squeeze(1)
        values = pooled if values is None else torch.cat([values, pooled], dim=1)
    keep = (max(now - 1, 0) if overlap else now) * ratio
    state[f"{name} tail"], state[f"{name} tail first"] = projected[:, keep - tail_first:].clone(), keep
    state[f"{name} windows"], state[f"{name} entries"] = now, values
    if values is None:
        values = projected.new_zeros((projected.shape[0], 0, head_dim))
    count = values.shape[1]
    zeros = torch.zeros(count, dtype=torch.long, device=values.device)
    return Entries(values, zeros, torch.arange(count, device=values.device), ratio)


def _generation_keys(module, hidden_states, kv, cache) -> Keys:
    """The keys inside `generate` / `prefill`: every rank keeps the last `sliding_window - 1`
    key-value rows and the entries so far (the layer's decoding state, the same on every rank);
    the chunk's rows and projections join them (gathered from its shards)."""
    group, _, rank = cache.ulysses
    lens = cache.chunk_lens
    state = cache.mixer_state(module.layer_idx, hidden_states.shape[1])
    first = cache.forward_start

    def whole(x):   # the chunk's tokens on every rank
        return x if lens is None else all_gather_sequence(x, lens, 1, group)
    held = state.get("window")
    rows = whole(kv) if held is None else torch.cat([held, whole(kv)], dim=1)
    rows_first = first - (0 if held is None else held.shape[1])
    state["window"] = rows[:, rows.shape[1] - min(module.sliding_window - 1, rows.shape[1]):].clone()
    entries = index_entries = None
    compressor = module.compressor
    if compressor is not None:
        projected = torch.cat([compressor.kv_proj(hidden_states), compressor.gate_proj(hidden_states)], dim=-1)
        overlap = module.layer_type == "compressed_sparse_attention"
        entries = _grown(state, "compressor", compressor, whole(projected), first, overlap, compressor.head_dim)
        if overlap:
            indexer = compressor.indexer
            projected = torch.cat([indexer.kv_proj(hidden_states), indexer.gate_proj(hidden_states)], dim=-1)
            index_entries = _grown(state, "indexer", indexer, whole(projected), first, True, indexer.head_dim)
    offset = first + (sum(lens[:rank]) if lens is not None else 0)
    queries = torch.arange(offset, offset + hidden_states.shape[1], device=hidden_states.device)
    return Keys(rows, rows_first, entries, index_entries, queries, torch.zeros_like(queries))


def _v4_attention(module, hidden_states: torch.Tensor, position_embeddings, position_ids, keys_of) -> torch.Tensor:
    """DeepseekV4Attention's output (the module doc), its queries over the keys `keys_of(kv)`
    gives for this rank's key-value head `kv` `[B, S_local, D]` (`_training_keys`,
    `_generation_keys`)."""
    B, S, _ = hidden_states.shape
    D, rope = module.head_dim, _rope(module)
    cos, sin = position_embeddings[module.rope_layer_type]
    q_residual = module.q_a_norm(module.q_a_proj(hidden_states))
    q = rope(module.q_b_norm(module.q_b_proj(q_residual).view(B, S, -1, D).transpose(1, 2)), cos, sin)
    kv = rope(module.kv_norm(module.kv_proj(hidden_states)).view(B, S, -1, D).transpose(1, 2), cos, sin)[:, 0]
    keys = keys_of(kv)
    chosen = _entry_choice(module, hidden_states, q_residual, position_ids, keys.index_entries, keys.queries,
                           keys.query_starts)
    window = _window(keys.queries, keys.query_starts, module.sliding_window)
    window = torch.where(window >= 0, window - keys.first, EMPTY).expand(B, -1, -1)
    entries = keys.entries if keys.entries is not None and keys.entries.values.shape[1] else None
    tiles = []
    for first in range(0, S, QUERY_TILE):
        part = slice(first, first + QUERY_TILE)
        tiles.append(checkpoint(_attend_tile, q[:, :, part], keys.kv, window[:, part], entries,
                                None if chosen is None else chosen[:, part], keys.queries[part],
                                keys.query_starts[part], module.sinks, module.scaling, use_reentrant=False))
    out = rope(torch.cat(tiles, dim=2), cos, -sin)                                  # the values' rope undone
    grouped = module.o_a_proj(out.transpose(1, 2).reshape(B, S, module.config.o_groups, -1)).flatten(2)
    return module.o_b_proj(grouped)


def v4_forward(self, call, hidden_states: torch.Tensor, position_embeddings, position_ids=None, **_):
    """DeepseekV4Attention's forward over the sequence (the protocol around it: family.py);
    returns (output, None)."""
    return _v4_attention(self, hidden_states, position_embeddings, position_ids,
                         lambda kv: _training_keys(self, hidden_states, kv, call)), None


def v4_generation(self, hidden_states: torch.Tensor, cache, position_embeddings, position_ids=None, **_):
    """`v4_forward` inside `generate` / `prefill`: the same attention, over the decoding state
    every rank keeps."""
    return _v4_attention(self, hidden_states, position_embeddings, position_ids,
                         lambda kv: _generation_keys(self, hidden_states, kv, cache)), None


# generation: the training forward's attention over the keys the decoding cache keeps
# (`_generation_keys`) instead of the gathered ones (`_training_keys`)
FAMILY = Family("compressed", (Adapter(V4_CLASSES, "sparse_attention", v4_forward, SPARSE_ATTENTION,
                                       generation=v4_generation),),
                model_types=("deepseek_v4",))
