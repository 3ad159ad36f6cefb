"""Sequence-parallel inference for Hugging Face causal LMs: a Ulysses prefill of a long
prompt, then generation from a head-sharded KV cache.

After the prefill's all-to-all every rank holds the K/V of *its* heads for the *whole*
prompt, which is the layout decoding wants, so the cache is kept exactly so
(`HeadShardedCache`) and never reshuffled:

* **Prefill** (`prefill`): the prompt is sharded along the sequence (`shard_batch`) and
  the model runs on every rank with the ``"ulysses"`` attention. Each layer's
  `cache.update` receives the rank's sequence shard of K/V for every KV head, trades it
  for its own KV heads over the whole shard set (one more all-to-all of K/V only) and
  stores that; the attention itself runs as in training. ``logits_to_keep=1``: no
  `[S, vocab]` logits; the last position's logits come from the rank that holds it.
* **Decode** (`generate`, or `model(next_ids, past_key_values=cache)` inside
  `decoding(cache)`): every rank runs the model on the same new token(s) (weights are
  replicated in a sequence-parallel group). In each layer the cache appends the new K/V
  of the rank's own KV heads; the attention computes the rank's query heads over its
  cache (bottom-right causal) and all-gathers the head outputs, so every rank goes on
  with the same full hidden state and draws the same token.

Per-rank KV memory is 1/P of a single-device cache when the KV heads split over the P
ranks, 1/Hkv when they are replicated (fewer KV heads than ranks).
"""

import contextlib
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..groups import collective_device, resolve_group
from ..layout import head_plan_error, place_heads
from ..reference.exchange import SeqToHeads
from .attention import _STATE as _ATTN_STATE
from .attention import _require_transformers, _sp_group, get_sequence_parallel_group
from .batch import shard_batch, split_groups

_UNSUPPORTED_GENERATION = {
    "num_beams": (1, "beam search"),
    "num_beam_groups": (1, "group beam search"),
    "penalty_alpha": (None, "contrastive search"),
    "assistant_model": (None, "assisted generation"),
    "prompt_lookup_num_tokens": (None, "prompt lookup decoding"),
}


# ------------------------------------------------------------------------ the cache

def _cache_base():
    _require_transformers()
    from transformers import DynamicCache

    return DynamicCache


def _head_counts(model) -> Tuple[int, int]:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    return hq, hkv


def make_cache(model, group=None):
    """A `HeadShardedCache` for `model` on this rank of `group` (default: the group set by
    `register` / `set_sequence_parallel_group`). It is a transformers `DynamicCache`."""
    base = _cache_base()
    group = group if group is not None else get_sequence_parallel_group()

    class HeadShardedCache(base):
        """KV cache of one rank of a Ulysses group: the K/V of the KV heads this rank owns
        (split, or replicated when Hkv < P), for the whole sequence. `update` knows two
        modes: during `prefill` it receives the rank's sequence shard of every KV head and
        exchanges it; while decoding it receives the new tokens' K/V of every KV head,
        identical on every rank, and keeps its own heads."""

        def __init__(self):
            super().__init__()
            self.group, self.world, self.rank = resolve_group(group)
            self.num_q_heads, self.num_kv_heads = _head_counts(model)
            err = head_plan_error(self.world, self.num_q_heads, self.num_kv_heads)
            if err:
                raise ValueError(f"HeadShardedCache: {err}")
            self.q_heads = place_heads(self.num_q_heads, self.world)
            self.kv_heads = place_heads(self.num_kv_heads, self.world)
            self.prefill_lens: Optional[List[int]] = None   # set while a prefill runs

        def own_q_heads(self) -> slice:
            start = self.q_heads.source_head(self.rank)
            return slice(start, start + self.q_heads.local)

        def own_kv_heads(self) -> slice:
            start = self.kv_heads.source_head(self.rank)
            return slice(start, start + self.kv_heads.local)

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            # transformers' layout: [B, H, S, D]
            if self.prefill_lens is not None:
                if self.world == 1:
                    mine = key_states, value_states
                else:
                    k, v = (x.transpose(1, 2).contiguous() for x in (key_states, value_states))
                    k, v = SeqToHeads.apply(self.group, self.rank, self.prefill_lens, k, v)
                    mine = k.transpose(1, 2), v.transpose(1, 2)
                super().update(mine[0], mine[1], layer_idx, *args, **kwargs)
                return key_states, value_states   # the prefill's attention runs as in training
            own = self.own_kv_heads()
            return super().update(key_states[:, own], value_states[:, own], layer_idx, *args, **kwargs)

        def bytes_per_rank(self) -> int:
            """Bytes of K/V this rank holds."""
            total = 0
            for layer in self.layers:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        total += t.numel() * t.element_size()
            return total

    return HeadShardedCache()


def is_head_sharded(cache) -> bool:
    return cache is not None and type(cache).__name__ == "HeadShardedCache" and hasattr(cache, "prefill_lens")


# ------------------------------------------------------------------------ decoding

@contextlib.contextmanager
def decoding(cache):
    """Within this context every call of the ``"ulysses"`` attention is a decode step
    over `cache` (`attention.decode_attention`): the new tokens, the same on every rank,
    attend to the cache of this rank's heads. `generate` enters it."""
    if not is_head_sharded(cache):
        raise TypeError(f"decoding() needs the HeadShardedCache of prefill/make_cache, got {type(cache).__name__}")
    previous, _ATTN_STATE.decode_cache = _ATTN_STATE.decode_cache, cache
    try:
        yield cache
    finally:
        _ATTN_STATE.decode_cache = previous


# ----------------------------------------------------------------------- public API

def _groups(group):
    group = group if group is not None else get_sequence_parallel_group()
    group, ring = split_groups(group)
    if ring is not None or _ATTN_STATE.ring_group is not None:
        raise ValueError("ulysses_kernels.hf inference: Ulysses x Ring groups are not supported yet "
                         "(pure Ulysses only: the ring dimension would hold sequence shards of the cache)")
    if group is None:
        group = _ATTN_STATE.group if _ATTN_STATE.group_set else None
    _sp_group()  # refuses an unset group in a multi-rank world
    return group


def _same_prompt_everywhere(input_ids, group, where):
    """Every rank must pass the same prompt: one all-gather of (shape, checksum) so a
    mismatch raises on every rank instead of desynchronising the collectives."""
    group, world, _ = resolve_group(group)
    if input_ids.dim() != 2:
        raise ValueError(f"{where}: input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    if group is None or world == 1:
        return
    ids = input_ids.detach().to(torch.int64).cpu()
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64).view_as(ids) % 1000003
    mine = torch.tensor([ids.shape[0], ids.shape[1], int((ids * weights).sum())], dtype=torch.int64)
    dev = collective_device(group)
    got = [torch.empty(3, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(got, mine.to(dev), group=group)
    if any(not torch.equal(g.cpu(), got[0].cpu()) for g in got):
        raise ValueError(f"{where}: the ranks of the sequence-parallel group passed different prompts "
                         f"(shapes/checksums {[g.tolist() for g in got]}); every rank must pass the same input_ids")


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, group=None, *, cache=None):
    """Run the prompt `[B, S]` (the same on every rank) through `model` sequence-parallel
    and return ``(logits, cache)``: the last position's logits `[B, vocab]` (on every rank)
    and a `HeadShardedCache` holding this rank's KV heads for all S tokens, which
    plugs into the model's next forward inside `decoding(cache)`. An existing `cache`
    is extended (chunked prefill: each chunk attends to the cache and causally to itself
    is NOT supported yet; pass a fresh cache)."""
    group = _groups(group)
    _same_prompt_everywhere(input_ids, group, "prefill")
    cache = cache if cache is not None else make_cache(model, group)
    if cache.get_seq_length() != 0:
        raise ValueError("prefill: the cache already holds tokens; chunked prefill (appending a chunk to a "
                         "filled cache) is not supported yet: prefill the whole prompt into a fresh cache")
    group, world, rank = resolve_group(group)
    batch = shard_batch(input_ids, group)
    if input_ids.shape[1] < world:
        raise ValueError(f"prefill: a prompt of {input_ids.shape[1]} tokens is shorter than the "
                         f"sequence-parallel group ({world} ranks); every rank needs at least one token")
    cache.prefill_lens = list(batch.seq_lens)
    try:
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, **{_cache_keyword(model): cache},
                    use_cache=True, logits_to_keep=1, ulysses_cu_seqlens=batch.cu_seqlens,
                    ulysses_seq_lens=list(batch.seq_lens))
    finally:
        cache.prefill_lens = None
    logits = out.logits[:, -1].contiguous()
    if world > 1:  # the last token lives on the last rank of the group
        dev = collective_device(group)
        last = logits.to(dev)
        src = dist.get_global_rank(group, world - 1) if group is not None else world - 1
        dist.broadcast(last, src=src, group=group)
        logits = last.to(logits.device)
    return logits, cache


def _cache_keyword(model) -> str:
    """transformers renamed the forward's `past_key_values` to `cache` (5.2x, with a
    deprecation warning for the old name): use whichever this model's forward takes."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _check_generation_kwargs(model, kwargs):
    config = kwargs.get("generation_config")
    for name, (neutral, what) in _UNSUPPORTED_GENERATION.items():
        value = kwargs.get(name, getattr(config, name, neutral) if config is not None else neutral)
        if value is None and neutral is None:
            continue
        if value != neutral:
            raise ValueError(f"ulysses_kernels.hf.generate: {what} ({name}={value!r}) is not supported")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError("ulysses_kernels.hf.generate: padded prompts (attention_mask with zeros) are not "
                         "supported; generate prompts of one length together, or one at a time")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and \
            any(t == "sliding_attention" for t in (getattr(config, "layer_types", None) or ["sliding_attention"])):
        raise ValueError(f"ulysses_kernels.hf.generate: sliding-window attention (window {window}) is not supported")


def _share_rng(group, device):
    """The first rank's default RNG state on every rank, so sampling draws the same tokens
    everywhere (the logits are identical on every rank)."""
    group, world, _ = resolve_group(group)
    if group is None or world == 1:
        return
    dev = collective_device(group)
    src = dist.get_global_rank(group, 0)
    state = torch.get_rng_state().to(dev)
    dist.broadcast(state, src=src, group=group)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device).to(dev)
        dist.broadcast(cuda_state, src=src, group=group)
        torch.cuda.set_rng_state(cuda_state.cpu(), device)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, group=None, **generation_kwargs) -> torch.Tensor:
    """`model.generate` over a sequence-parallel group: call it on every rank with the same
    prompt(s) `[B, S]`; every rank returns the same tokens as `model.generate` on one device.

    The prompt but its last token is prefilled sequence-parallel (`prefill`), then
    transformers' own generation loop runs on every rank in lockstep from the
    head-sharded cache (greedy and sampling, logits processors, stopping criteria: all of
    it is transformers'). Sampling draws from the first rank's RNG state, copied to every
    rank first. The ranks' tokens are compared at the end; a difference raises.
    Not supported (a ValueError on every rank): beam search and the other multi-candidate
    modes, padded prompts, sliding-window models, Ulysses x Ring groups.
    """
    _check_generation_kwargs(model, generation_kwargs)
    group = _groups(group)
    _same_prompt_everywhere(input_ids, group, "generate")
    _, world, _ = resolve_group(group)
    cache = make_cache(model, group)
    if input_ids.shape[1] - 1 >= max(world, 1):
        prefill(model, input_ids[:, :-1], group, cache=cache)
    elif input_ids.shape[1] > 1:   # too short to shard: every rank computes its heads
        with decoding(cache):
            model(input_ids=input_ids[:, :-1], **{_cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)
    _share_rng(group, input_ids.device)
    with decoding(cache):
        out = model.generate(input_ids, **{_cache_keyword(model): cache}, **generation_kwargs)
    tokens = out.sequences if hasattr(out, "sequences") else out
    _same_tokens_everywhere(tokens, group)
    return out


def _same_tokens_everywhere(tokens, group):
    group, world, _ = resolve_group(group)
    if group is None or world == 1:
        return
    dev = collective_device(group)
    mine = torch.tensor(list(tokens.shape), dtype=torch.int64, device=dev)
    shapes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(shapes, mine, group=group)
    same = all(torch.equal(s, shapes[0]) for s in shapes)
    if same:
        got = [torch.empty_like(tokens, device=dev) for _ in range(world)]
        dist.all_gather(got, tokens.to(dev), group=group)
        same = all(torch.equal(g, got[0]) for g in got)
    if not same:
        raise RuntimeError("ulysses_kernels.hf.generate: the ranks generated different tokens (their logits "
                           "differ: nondeterministic kernels, or different weights/generation settings per rank)")
