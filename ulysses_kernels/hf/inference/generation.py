"""Sequence-parallel inference for Hugging Face causal LMs: a Ulysses prefill of a long
prompt (in chunks if asked), then generation from a head-sharded KV cache.

After a Ulysses all-to-all every rank holds *its* heads for the *whole* sequence, which
is the layout decoding wants, so the cache keeps exactly that (`HeadShardedCache`) and is
never reshuffled. Every model forward of the prefill and the decode is a **chunk** of new
tokens, attending to the cache and causally to itself:

The cache and the two halves of a layer's attention are `cache.HeadShardedCache`; they
run on the path the dispatch picks for the chunk's tensors, like training (its exchange
and its attention kernel). Two kinds of chunk:

* **Sharded chunk** (the prefill, `prefill`): the chunk is split along the sequence over
  the Ulysses group. Each layer's `cache.update` trades the rank's shard of K/V for its
  own KV heads over the whole chunk (one all-to-all of K/V); the attention trades the
  queries likewise, attends over the cache, and trades the output back (heads to
  sequence). ``logits_to_keep=1``: no `[S, vocab]` logits.
* **Replicated chunk** (decode, and chunks shorter than the Ulysses degree): every rank
  runs the model on the same token(s) (weights are replicated in a sequence-parallel
  group); the cache keeps the rank's own KV heads, the attention computes the rank's
  query heads and all-gathers the head outputs, so every rank continues with the same
  hidden state and draws the same token.
* **Ulysses x Ring**: the ring dimension holds sequence shards of the cache. All ring
  ranks run the same chunk (each with its Ulysses group); one of them, the one holding
  the fewest tokens, appends the chunk's K/V (a windowed layer's: every ring rank,
  below); each attends over what it holds (causally only where the chunk is) and the
  partial outputs are merged by log-sum-exp over the ring group. Prefill uses one chunk per ring rank by default, so each holds 1/R of the
  prompt. The non-attention layers of a chunk run on every ring rank (R times).

The attention variants of a layer (docs/api.md, "Attention variants") reach the cache's
attention with the queries (hf/core/attention.py's `layer_variants`), so per-layer windows
(Gemma's alternating `layer_types`, Qwen2's `max_window_layers`) follow:

* **Sliding windows.** HF's `sliding_window=W` is the band `(W - 1, 0)`: the query at
  position p sees keys p - W + 1 .. p. After a chunk's attention the layer keeps its last
  W - 1 tokens, the most the next query (at position L, the tokens so far) can see, so a
  windowed layer holds W - 1 tokens between forwards and W - 1 + T while a chunk of T
  attends (transformers' own sliding-window cache keeps the same). The held keys stay
  the newest, contiguous, so the kernels' bottom-right band (off = Sk - T) is the window
  at the global positions. With a ring, a windowed layer lives whole on every ring rank
  (each appends every chunk; W - 1 tokens each): the ring rank holding the chunk attends
  and broadcasts the output over the ring, no merge.
* **Softcap** applies inside every attention (each ring rank's partial included).
* **Sinks** are the layer's `[Hq]` logits over the global heads: each rank takes its
  query heads' slice. With a ring the partials merge without them and the sinks join
  once after (`ring/merge.py`, `merge_sinks`), or they would count R times.
* **MLA** (DeepSeek-V3): the layer caches a one-head latent (and its rotary key), which
  every rank keeps whole, like a single KV head, and expands it into every head's keys
  and values itself; the cache's attention takes this rank's heads of them, values with
  their own head dim (the output has it).

Per-rank KV memory: the prompt's K/V over the KV heads split (or, with fewer KV heads
than the Ulysses degree, replicated) over the Ulysses ranks, and over ring ranks by tokens;
a windowed layer holds W - 1 tokens of the rank's heads, on every ring rank; an MLA latent
is whole on every rank.
"""

import contextlib
import functools
import inspect
import math
from typing import Optional

import torch
import torch.distributed as dist

from ...distributed.collectives import all_gather_tensor, broadcast_tensor
from ...layout import split_lengths
from ..core.attach import sequence_parallel_model
from ..core.attention import _require_transformers
from ..families.adapters import adapted_kind, generation_problem, own_cache_class, prepare_cache
from ..families.vision.vision import merged_prompt
from ..families.vision.vision_shard import SHARD_KEY, VISION_KEYS, TokenShard, has_images, vision_inputs
from ..model import refusal, unwrap

_UNSUPPORTED_GENERATION = {
    "num_beams": (1, "beam search"),
    "num_beam_groups": (1, "group beam search"),
    "penalty_alpha": (None, "contrastive search"),
    "assistant_model": (None, "assisted generation"),
    "prompt_lookup_num_tokens": (None, "prompt lookup decoding"),
}


def make_cache(model, group=None, *, backend: Optional[str] = None):
    """A `HeadShardedCache` (cache.py) for `model` on this rank: on the model's context
    (context.py; the first time, one on `group`, or `register`'s), the backend of that
    context unless `backend` is given. It is a transformers `DynamicCache`; `prefill`
    fills it, `decoding(cache)` reads it."""
    _require_transformers()
    from .cache import head_sharded_cache_class

    context = sequence_parallel_model(model, group)
    if context.ring()[1] > 1 and any(adapted_kind(m) for m in unwrap(model).modules()):
        raise refusal(unwrap(model), "its token mixers' conv and recurrent states are kept by heads within a Ulysses "
                                     "group; generation on a ring is not supported for them",
                      "Generate with Ulysses only (ring_size=1); training runs on a ring.")
    declared = generation_problem(unwrap(model))
    if declared:
        raise refusal(unwrap(model), declared, "Generate on one device, or with the package's own families.")
    cache_class = head_sharded_cache_class(own_cache_class(unwrap(model)))
    cache = cache_class(model, context.group, context.ring_group, context=context,
                        backend=backend if backend is not None else context.backend)
    prepare_cache(unwrap(model), cache)
    return cache


@contextlib.contextmanager
def decoding(cache):
    """Within this context every call of the ``"ulysses"`` attention of the cache's model
    is a chunk over `cache` (see the module doc): `model(next_ids, cache=cache)` works in
    custom loops. `generate` and `prefill` enter it themselves."""
    from .cache import HeadShardedCache

    if not isinstance(cache, HeadShardedCache):
        raise TypeError(f"decoding() needs the HeadShardedCache of prefill/make_cache, got {type(cache).__name__}")
    context = cache.context
    previous, context.inference_cache = context.inference_cache, cache
    try:
        yield cache
    finally:
        context.inference_cache = previous


# ----------------------------------------------------------------------- public API

def _cache_keyword(model) -> str:
    """transformers renamed the forward's `past_key_values` to `cache` (5.2x, with a
    deprecation warning for the old name): use whichever this model's forward takes."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _grid(cache):
    return [g for g in (cache.ulysses[0], cache.ring[0]) if g is not None and dist.get_world_size(g) > 1]


def _same_everywhere(t: torch.Tensor, groups, what: str, error=ValueError):
    """`t` (int64) equal on every rank of every group, else `error` on every rank."""
    for group in groups:
        got = all_gather_tensor(t, group)
        if any(not torch.equal(g, got[0]) for g in got):
            raise error(what)


def _prompt_signature(input_ids):
    ids = input_ids.detach().to(torch.int64).cpu()
    weights = (torch.arange(1, ids.numel() + 1, dtype=torch.int64) % 1000003).view_as(ids)
    return torch.tensor([ids.shape[0], ids.shape[1], int((ids * weights).sum())], dtype=torch.int64)


def _check_prompt(input_ids, cache, where):
    if input_ids.dim() != 2:
        raise ValueError(f"{where}: input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    _same_everywhere(_prompt_signature(input_ids), _grid(cache),
                     f"{where}: the ranks of the sequence-parallel group passed different prompts; every rank "
                     f"must pass the same input_ids")


def _run_chunk(model, cache, ids, start, merged=None):
    """One forward of `ids` `[B, T]` (global positions from `start`) over the cache; returns
    the last position's logits `[B, vocab]`, the same on every rank. `merged`: a VLM
    prompt's merged inputs (vision.py), whose slice the language model takes instead."""
    group, world, rank = cache.ulysses
    B, T = ids.shape
    positions = torch.arange(start, start + T, device=ids.device).unsqueeze(0).expand(B, T)
    sharded = world > 1 and T >= world
    span = (start, T)
    if sharded:
        lens = split_lengths(T, world)
        lo = sum(lens[:rank])
        ids, positions = ids[:, lo:lo + lens[rank]], positions[:, lo:lo + lens[rank]]
        span = (start + lo, lens[rank])
    extra = {}
    if merged is not None:   # the language model cuts its slice of the merged prompt
        extra[SHARD_KEY] = TokenShard(shape=tuple(merged["inputs_embeds"].shape[:2]), ranges=[span], merged=merged)
    with decoding(cache), cache.sharded_chunk(lens if sharded else None):
        out = model(input_ids=ids, position_ids=None if merged is not None else positions, use_cache=True,
                    logits_to_keep=1, **{_cache_keyword(model): cache}, **extra)
    logits = out.logits[:, -1].contiguous()
    if sharded:   # the last token lives on the last Ulysses rank
        logits = broadcast_tensor(logits, world - 1, group)
    return logits


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, group=None, *, cache=None, chunk_size: Optional[int] = None,
            **multimodal):
    """Run the prompt `[B, S]` (the same on every rank) through `model` sequence-parallel
    and return ``(logits, cache)``: the last position's logits `[B, vocab]` (the same on
    every rank) and the `HeadShardedCache` (extended when given). Use the cache inside
    `decoding(cache)`: ``model(next_ids, cache=cache)``.

    chunk_size: tokens per forward (default: the whole prompt; with a ring, one chunk per
    ring rank). Each chunk attends to the cache and causally to itself, so activation
    memory is bounded by the chunk while the cache grows.

    multimodal: a vision-language model's images as its processor gives them
    (`pixel_values`, `image_grid_thw`, `mm_token_type_ids`, ...; vision.py): one forward
    merges the whole prompt (every rank encodes every image), then the chunks take their
    slices of it. The prompt must start on an empty cache.
    """
    cache = cache if cache is not None else make_cache(model, group)
    _check_prompt(input_ids, cache, "prefill")
    S = input_ids.shape[1]
    if S == 0:
        raise ValueError("prefill: an empty prompt")
    if chunk_size is None:
        chunk_size = math.ceil(S / cache.ring[1])
    if chunk_size < 1:
        raise ValueError(f"prefill: chunk_size must be positive, got {chunk_size}")
    start, logits = cache.get_seq_length(), None
    merged = _merged_prompt(model, input_ids, multimodal, start)
    for c0, c1 in forward_spans(S, chunk_size, start, attention_chunk_size(model)):
        logits = _run_chunk(model, cache, input_ids[:, c0:c1], start + c0, merged)
    return logits, cache


def _merged_prompt(model, input_ids, multimodal, start):
    """A VLM prompt's merged inputs (vision.py), or None for a prompt without images."""
    unknown = sorted(set(multimodal) - set(VISION_KEYS))
    if unknown:
        raise TypeError(f"prefill: unexpected keyword argument {unknown[0]!r}")
    inputs = vision_inputs(multimodal)
    if not has_images(inputs):
        return None
    if start:
        raise ValueError("prefill: a prompt with images must start on an empty cache (its mRoPE positions are "
                         f"numbered from the first token), but the cache holds {start} tokens")
    return merged_prompt(unwrap(model), input_ids, inputs)


def attention_chunk_size(model) -> Optional[int]:
    """The attention_chunk_size of a model with chunked-attention layers (Llama 4), else None."""
    from ..model import text_configs

    config = getattr(model, "config", None)
    for sub in text_configs(config) if config is not None else []:
        kinds = getattr(sub, "layer_types", None) or []
        if "chunked_attention" in kinds and getattr(sub, "attention_chunk_size", None):
            return int(sub.attention_chunk_size)
    return None


def forward_spans(S: int, chunk_size: int, start: int, attention_chunk: Optional[int]):
    """The prompt's forwards `(c0, c1)`: `chunk_size` tokens each, also cut where the
    global position `start + c` is a multiple of `attention_chunk` (a chunked layer's
    forward stays inside one of its chunks, cache.py)."""
    cuts = set(range(0, S, chunk_size))
    if attention_chunk:
        first = -start % attention_chunk
        cuts.update(range(first, S, attention_chunk))
    cuts = sorted(c for c in cuts if 0 <= c < S) + [S]
    return list(zip(cuts[:-1], cuts[1:]))


def _check_generation_kwargs(model, input_ids, kwargs):
    config = kwargs.get("generation_config")
    for name, (neutral, what) in _UNSUPPORTED_GENERATION.items():
        value = kwargs.get(name, getattr(config, name, neutral) if config is not None else neutral)
        if value not in (neutral, None):   # None: a GenerationConfig's unset field (the default mode)
            raise ValueError(f"ulysses_kernels.hf.generate: {what} ({name}={value!r}) is not supported")
    padding = _prompt_padding(model, input_ids, kwargs)
    if padding:
        raise ValueError(f"ulysses_kernels.hf.generate: padded prompts ({padding}) are not supported; generate "
                         "prompts of one length together, or one at a time")


def _prompt_padding(model, input_ids, kwargs) -> Optional[str]:
    """What transformers' generate would mask of the prompt as padding, or None. The prefill
    attends to every prompt token and the cache takes no padding mask (docs/hf_generation.md, "Not
    supported"), so a prompt with padding is refused here, from the arguments alone, on every
    rank, before the prefill: not by the mask function at transformers' first forward (its
    prefill of the last token). The mask is the one given, or the one transformers infers
    without it: `input_ids != pad_token_id` where the prompt holds the pad token, unless the
    pad token is an eos token."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return None if bool(mask.bool().all()) else "attention_mask with zeros"
    pad, eos = _special_tokens(model, kwargs)
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return None
    return (f"the prompt holds pad_token_id {pad}, which transformers' generate masks as padding when no "
            "attention_mask is given")


def _special_tokens(model, kwargs):
    """(pad token id or None, eos token ids) of the generation `model.generate(**kwargs)` runs:
    transformers' own merge (kwargs over `generation_config` over the model's)."""
    kwargs = dict(kwargs)
    config = kwargs.pop("generation_config", None)
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        config, _ = prepare(config, **kwargs)
    elif config is None:
        config = getattr(model, "generation_config", None)
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    eos = [] if eos is None else torch.as_tensor(eos).flatten().tolist()
    return (None if pad is None else int(pad)), eos


def _check_last_token_is_text(input_ids, multimodal):
    """The prompt but its last token is prefilled with the images; transformers' loop then
    continues from the model's rope deltas, which holds only for a text token."""
    types = multimodal.get("mm_token_type_ids")
    if types is None:
        types = multimodal.get("token_type_ids")
    if input_ids.shape[1] < 2 or (types is not None and bool((types[:, -1] != 0).any())):
        raise ValueError("ulysses_kernels.hf.generate: a prompt with images must end with a text token (the "
                         "processor's generation prompt does)")


@contextlib.contextmanager
def _inputs_after_the_cache(model, cache):
    """Within: transformers' generate feeds its first forward only the prompt tokens the cache
    has not seen. It cuts them itself where it reads the prompt's length from an attention
    mask; a model whose forward takes none (xLSTM) would get the whole prompt again after the
    prefill, so its `prepare_inputs_for_generation` gets the cut here (a no-op wherever
    transformers made it)."""
    original = model.prepare_inputs_for_generation
    own = vars(model).get("prepare_inputs_for_generation")

    @functools.wraps(original)   # transformers checks the generation kwargs against its signature
    def prepare(input_ids, *args, **kwargs):
        seen = cache.get_seq_length()
        if not args and kwargs.get("next_sequence_length") is None and 0 < seen < input_ids.shape[1]:
            kwargs["next_sequence_length"] = input_ids.shape[1] - seen
        return original(input_ids, *args, **kwargs)

    model.prepare_inputs_for_generation = prepare
    try:
        yield
    finally:
        if own is None:
            del model.prepare_inputs_for_generation
        else:
            model.prepare_inputs_for_generation = own


def _share_rng(cache, device):
    """The first rank's default RNG state on every rank of the grid, so sampling draws the
    same tokens everywhere (the logits are identical on every rank)."""
    for group in _grid(cache):
        torch.set_rng_state(broadcast_tensor(torch.get_rng_state(), 0, group))
        if device.type == "cuda":
            torch.cuda.set_rng_state(broadcast_tensor(torch.cuda.get_rng_state(device), 0, group).cpu(), device)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, group=None, *, prefill_chunk_size: Optional[int] = None,
             **generation_kwargs):
    """`model.generate` over a sequence-parallel group: call it on every rank with the same
    prompt(s) `[B, S]`; every rank returns what `model.generate` returns on one device.

    group: a process group (pure Ulysses), `init_sequence_parallel`'s groups (Ulysses x
    Ring too), or None for the groups `register` set. The prompt but its last token is
    prefilled sequence-parallel (`prefill`, `prefill_chunk_size`), then transformers' own
    generation loop runs on every rank in lockstep from the head-sharded cache (greedy and
    sampling, logits processors, stopping criteria: all of it is transformers'). Sampling
    draws from the first rank's RNG state, copied to every rank first; the ranks' tokens
    are compared at the end (a difference raises). Sliding windows, softcap, sinks and MLA
    run like on one device (the module doc). Not supported, with a ValueError on every
    rank: beam search and the other multi-candidate modes, padded prompts (an attention_mask
    with zeros, or the pad token in a prompt passed without one: transformers masks it).
    """
    _check_generation_kwargs(model, input_ids, generation_kwargs)
    multimodal = {k: generation_kwargs.pop(k) for k in VISION_KEYS if k in generation_kwargs}
    cache = make_cache(model, group)
    _check_prompt(input_ids, cache, "generate")
    if has_images(vision_inputs(multimodal)):   # the prefill takes the prompt but its last token
        _check_last_token_is_text(input_ids, multimodal)
        multimodal = {k: (v[:, :-1] if k in ("mm_token_type_ids", "token_type_ids") else v)
                      for k, v in multimodal.items()}
    else:   # text only: the token types say nothing the model needs
        multimodal = {}
    if input_ids.shape[1] > 1:
        prefill(model, input_ids[:, :-1], cache=cache, chunk_size=prefill_chunk_size, **multimodal)
    _share_rng(cache, input_ids.device)
    with decoding(cache), _inputs_after_the_cache(model, cache):
        out = model.generate(input_ids, **{_cache_keyword(model): cache}, **generation_kwargs)
    tokens = out.sequences if hasattr(out, "sequences") else out
    _same_everywhere(torch.tensor(list(tokens.shape), dtype=torch.int64), _grid(cache),
                     "generate: the ranks generated sequences of different lengths", RuntimeError)
    _same_everywhere(tokens.detach().to(torch.int64).cpu(), _grid(cache),
                     "generate: the ranks generated different tokens (their logits differ: nondeterministic "
                     "kernels, or different weights or generation settings per rank)", RuntimeError)
    return out
