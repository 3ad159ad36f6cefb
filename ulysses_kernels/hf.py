"""Hugging Face transformers integration: Ulysses sequence parallelism for HF causal LMs.

transformers is an optional dependency (`pip install ulysses-kernels[hf]`); this module
imports it lazily, so the rest of the package works without it.

Typical training step (every rank of an SP group holds the same full batch; each DP
group a different one)::

    import ulysses_kernels as uk
    from ulysses_kernels import hf as ukhf

    groups = uk.init_sequence_parallel(sp_size)
    ukhf.register(groups.sp_group)                      # attn_implementation="ulysses"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ulysses")
    ukhf.patch_model(model)                              # optional: tiled MLP + tiled loss
    model = ukhf.apply_fsdp(model, groups)               # or apply_ddp, or neither
    batch = ukhf.shard_batch(input_ids, groups.sp_group, position_ids=pos)
    loss = ukhf.causal_lm_loss(model, batch, groups.sp_group)   # global mean, all ranks
    loss.backward()
    # without FSDP/DDP: ukhf.allreduce_gradients(model, groups.sp_group, groups.dp_group)

Design notes
------------
* **Attention.** `register()` adds `ulysses_attention_forward` to transformers'
  `AttentionInterface` under the name ``"ulysses"``. Every attention layer then calls
  `ulysses_kernels.ulysses_attention` on the SP group set by `set_sequence_parallel_group`
  (or `register(group)`). Causal unless the layer says otherwise (`module.is_causal`).
* **Masks.** `register()` also adds a mask function to `AttentionMaskInterface` under the
  same name, so transformers builds *no* mask tensor for this implementation: for an
  unpadded batch the mask function returns `None` (attention is causal and the document
  boundaries come from the position ids, below). A 2-D padding mask with any zero (on
  any rank of the group: the ranks agree through one tiny all-reduce per forward, so all
  of them raise together instead of some hanging) raises `ValueError`; so do custom 4-D
  masks, sliding windows shorter than the global sequence, attention logit softcapping,
  attention sinks, dropout > 0 and KV caches (generation). Nothing is silently dropped.
* **Packed documents.** Position ids restarting at 0 (any break in `p[t] = p[t-1] + 1`,
  the rule transformers itself uses) mark document boundaries; attention never crosses
  them. The robust path is `shard_batch`: it computes the *global* `cu_seqlens` once from
  the full batch before sharding and hands them (and every rank's length) to the
  attention through the model's ``**kwargs`` (keys ``ulysses_cu_seqlens`` and
  ``ulysses_seq_lens``, which HF forwards untouched to the attention function). Without
  them, the attention all-gathers the local position-id shard along the group on every
  layer (a few bytes) and derives the same boundaries, so calling the model with global
  position ids by hand also works.
* **Position ids must be global.** Each rank's `position_ids` shard must hold the global
  positions of its tokens (rank r's shard of `arange(S)` for a single document). If the
  model is called without them, HF uses `arange(S_local)` on every rank and RoPE is wrong;
  the attention warns when every shard restarts at 0 exactly at the shard boundaries.
* **Loss.** See `shard_batch` and `sequence_parallel_loss`.
* **Gradients.** Parameters are replicated inside an SP group but every rank sees only its
  slice of the tokens, so the gradient of the global loss is the SUM over SP ranks of the
  local gradients (and the MEAN over DP ranks, each of which has its own batch).
  `allreduce_gradients` does this by hand; `apply_ddp` / `apply_fsdp` configure DDP / FSDP2
  on the whole DP x SP world to reduce with SUM and divide by dp_size only.
* **Memory.** `patch_model` makes the MLPs and the LM head + cross-entropy loop over
  sequence tiles (recomputing each tile in backward), so neither the MLP intermediate
  `[S, intermediate]` nor the logits `[S, vocab]` of the whole local sequence ever exist.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._layout import split_lengths
from .attention import ulysses_attention
from .comm import gather_sequence, resolve_group

__all__ = [
    "ATTN_IMPLEMENTATION", "register", "set_sequence_parallel_group", "get_sequence_parallel_group",
    "ulysses_attention_forward", "ulysses_mask_function", "cu_seqlens_from_position_ids",
    "SequenceParallelBatch", "shard_batch", "sequence_parallel_loss", "global_mean_from_sum",
    "causal_lm_loss", "allreduce_gradients", "apply_ddp", "apply_fsdp",
    "tiled_mlp", "tiled_cross_entropy_sum", "patch_model", "unpatch_model",
]

ATTN_IMPLEMENTATION = "ulysses"
IGNORE_INDEX = -100


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError("ulysses_kernels.hf needs Hugging Face transformers: "
                          "pip install 'ulysses-kernels[hf]' (or 'transformers>=4.56')") from exc
    return transformers


# ----------------------------------------------------------------------------- state

class _State:
    group = None          # the SP process group (None: default group / single process)
    group_set = False     # set_sequence_parallel_group was called
    backend: Optional[str] = None
    warned_local_positions = False


_STATE = _State()


def set_sequence_parallel_group(group, *, backend: Optional[str] = None) -> None:
    """Set the SP process group (and optionally the `ulysses_attention` backend) that the
    ``"ulysses"`` attention implementation uses. `group=None` means the default group."""
    _STATE.group = group
    _STATE.group_set = True
    _STATE.backend = backend


def get_sequence_parallel_group():
    """The SP group set by `set_sequence_parallel_group` / `register` (None = default)."""
    return _STATE.group


def _sp_group():
    """(group, world, rank) for the attention; refuses to guess in a multi-rank world."""
    if not _STATE.group_set and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        raise ValueError("ulysses attention: no sequence-parallel group set; call "
                         "ulysses_kernels.hf.register(sp_group) or set_sequence_parallel_group(sp_group) "
                         "(pass None explicitly to use the whole world)")
    return resolve_group(_STATE.group)


def register(group=None, *, backend: Optional[str] = None, name: str = ATTN_IMPLEMENTATION) -> str:
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
    set_sequence_parallel_group(group, backend=backend)
    return name


# ----------------------------------------------------------------------------- masks

def _group_any(flag: bool, group) -> bool:
    """True when `flag` is True on any rank of `group` (one tiny all-reduce)."""
    group, world, _ = resolve_group(group)
    if group is None or world == 1:
        return flag
    from ._checks import collective_device

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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
    group, world, _ = _sp_group()
    if group is not None and world > 1 and _group_any(problem is not None, group):
        problem = problem or "another rank of the sequence-parallel group got an unsupported attention_mask"
    if problem:
        raise ValueError(f"ulysses attention: {problem}. Sequence-parallel training expects "
                         "unpadded (optionally packed) batches: pack documents and mark them with "
                         "position_ids restarting at 0 instead of padding (see shard_batch).")
    return None


# ------------------------------------------------------------------ packed documents

def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Global document boundaries (int32 `cu_seqlens`) from global position ids.

    A document starts wherever `p[t] != p[t-1] + 1` (transformers' own rule). Returns None
    when every row is one contiguous run (no packing). Packed rows need batch size 1.
    """
    pos = position_ids
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2:
        raise ValueError(f"position_ids must be [batch, seq], got {tuple(position_ids.shape)}")
    S = pos.shape[1]
    if S <= 1:
        return None
    starts = (pos[:, 1:] - pos[:, :-1]) != 1
    if not bool(starts.any()):
        return None
    if pos.shape[0] != 1:
        if bool((pos == pos[:1]).all()):
            pos, starts = pos[:1], starts[:1]
        else:
            raise ValueError("ulysses attention: packed documents (position_ids restarting) need batch size 1; "
                             f"got position_ids of shape {tuple(position_ids.shape)}. Concatenate the batch "
                             "into one row instead.")
    idx = torch.nonzero(starts[0]).flatten() + 1
    bounds = torch.cat([idx.new_zeros(1), idx, idx.new_full((1,), S)])
    return bounds.to(dtype=torch.int32, device=position_ids.device)


def _global_positions(position_ids, group, world):
    """All-gather the local position-id shard along the sequence (fallback path)."""
    pos = position_ids
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    pos = pos.detach().to(torch.int64)
    if group is None or world == 1:
        return pos, [pos.shape[1]]
    # Ranks may hold [1, S] and [B, S] mixes; gather a [1, S_local] row unless truly batched.
    from ._checks import collective_device

    dev = collective_device(group)
    full = gather_sequence(pos.to(dev), group, dim=1).to(position_ids.device)
    lens = [len(c) for c in torch.tensor_split(torch.empty(full.shape[1]), world)]
    return full, lens


def _lengths_only(local_len, group, world, device):
    if group is None or world == 1:
        return [local_len]
    from ._checks import collective_device

    dev = collective_device(group)
    mine = torch.tensor([local_len], dtype=torch.int64, device=dev)
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    return [int(g.item()) for g in got]


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
    "softcap": "attention logit softcapping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
}


def ulysses_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              is_causal: Optional[bool] = None, **kwargs):
    """transformers attention function (``AttentionInterface``) running Ulysses attention.

    query `[B, Hq, S_local, D]`, key/value `[B, Hkv, S_local, D]` (transformers' layout) ->
    (`[B, S_local, Hq, D]`, None), like `sdpa_attention_forward`.
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
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{where}: query length {query.shape[2]} != key length {key.shape[2]} "
                         "(a KV cache / generation?); call the model with use_cache=False")
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
            full, lens = _global_positions(pos, group, world)
            _warn_local_positions(full, lens)
            if cu_seqlens is None:
                cu_seqlens = cu_seqlens_from_position_ids(full)
        else:
            lens = _lengths_only(query.shape[2], group, world, query.device)
    total = sum(lens)

    sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if sliding is not None and sliding > 0 and total > sliding:
        raise ValueError(f"{where}: sliding-window attention (window {sliding}) over a sequence of "
                         f"{total} tokens is not supported")
    if cu_seqlens is not None and query.shape[0] != 1:
        raise ValueError(f"{where}: packed documents need batch size 1, got {query.shape[0]}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    out = ulysses_attention(q, k, v, group=group, causal=bool(causal), softmax_scale=scaling,
                            seq_lens=lens if trusted else None, cu_seqlens=cu_seqlens,
                            backend=_STATE.backend)
    return out, None


# -------------------------------------------------------------------- batch sharding

@dataclass
class SequenceParallelBatch:
    """This rank's slice of a batch (see `shard_batch`).

    input_ids / position_ids / labels: `[B, S_local]` shards; labels are already shifted
    (labels[t] is the target of token t). cu_seqlens: global int32 document boundaries or
    None. seq_lens: every rank's local length.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]
    seq_lens: List[int]
    rank: int
    world: int

    def model_inputs(self) -> Dict[str, object]:
        """Keyword arguments for `model(**batch.model_inputs())` (no labels: see shard_batch)."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False,
                    ulysses_cu_seqlens=self.cu_seqlens, ulysses_seq_lens=list(self.seq_lens))

    @property
    def num_valid_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def shard_batch(input_ids: torch.Tensor, group=None, *, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                ignore_index: int = IGNORE_INDEX, labels_shifted: bool = False,
                mask_document_ends: bool = False) -> SequenceParallelBatch:
    """Shard a full batch `[B, S]` along the sequence for this rank of the SP group.

    Every rank of the group passes the same full batch. Labels (default: `input_ids`) are
    shifted *before* sharding: ``labels[t] = labels_in[t + 1]`` and the last is
    `ignore_index`, so the target of the last token of each shard (the first token of the
    next shard) is kept. Then call the model with ``labels=None``
    (``model(**batch.model_inputs())``) and compute the loss with `sequence_parallel_loss`
    or `causal_lm_loss`: HF's own loss shifts the labels again *locally*, which would
    drop one target at every shard boundary and misalign the rest, and averages over the
    local tokens only instead of the global count.

    position_ids: global positions (default `arange(S)` per row); restarting positions mark
    packed documents (B must then be 1), turned once into global `cu_seqlens` here.
    `mask_document_ends=True` sets the target of each document's last token to
    `ignore_index` (so no token learns to predict the next document). `labels_shifted=True`
    takes labels as already aligned (labels[t] = target of token t). An `attention_mask`
    may be passed only if it is all ones (padding is not supported; pack instead).
    S need not be divisible by the group size (shards follow `torch.tensor_split`).
    """
    group, world, rank = resolve_group(group)
    if input_ids.dim() != 2:
        raise ValueError(f"shard_batch: input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("shard_batch: padding (attention_mask with zeros) is not supported with sequence "
                         "parallelism; pack documents and mark them with position_ids instead")
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.shape[-1] != S:
        raise ValueError(f"shard_batch: position_ids {tuple(position_ids.shape)} do not match input_ids {(B, S)}")
    position_ids = position_ids.expand(B, S)
    cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    labels = input_ids if labels is None else labels
    if labels.shape != (B, S):
        raise ValueError(f"shard_batch: labels {tuple(labels.shape)} do not match input_ids {(B, S)}")
    if labels_shifted:
        shifted = labels.clone()
    else:
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
    if mask_document_ends and cu_seqlens is not None:
        ends = cu_seqlens[1:].long() - 1
        ends = ends[ends >= 0]
        shifted[:, ends] = ignore_index
    lens = split_lengths(S, world)

    def cut(t):
        return torch.tensor_split(t, world, dim=1)[rank].contiguous()

    return SequenceParallelBatch(input_ids=cut(input_ids), position_ids=cut(position_ids),
                                 labels=cut(shifted), cu_seqlens=cu_seqlens, seq_lens=lens,
                                 rank=rank, world=world)


# --------------------------------------------------------------------------- the loss

def global_mean_from_sum(local_sum: torch.Tensor, local_count, group=None) -> torch.Tensor:
    """Exact global mean from this rank's differentiable `local_sum` over its
    `local_count` valid tokens: returns a tensor whose *value* is
    ``sum_r local_sum_r / sum_r local_count_r`` on every rank and whose *gradient* flows
    only through this rank's `local_sum` (scaled by 1 / global count).

    One all-reduce of [sum, count] (a constant for autograd). Because each rank's
    backward covers its own tokens (the attention all-to-all carries the cross-rank
    terms), the full gradient of a replicated parameter is the SUM of the ranks'
    gradients over the SP group: see `allreduce_gradients` / `apply_ddp` / `apply_fsdp`.
    Ranks with zero valid tokens return the global mean too (gradient 0) and must still
    call backward. A group with no valid token at all gives 0.
    """
    group, world, _ = resolve_group(group)
    count = torch.as_tensor(local_count, dtype=torch.float64, device=local_sum.device).reshape(())
    stats = torch.stack([local_sum.detach().to(torch.float64), count])
    if group is not None and world > 1:
        from ._checks import collective_device

        dev = collective_device(group)
        s = stats.to(dev)
        dist.all_reduce(s, group=group)
        stats = s.to(local_sum.device)
    total_sum, total_count = stats[0], stats[1]
    denom = torch.clamp(total_count, min=1.0)
    others = (total_sum - local_sum.detach().to(torch.float64)).to(local_sum.dtype)
    return (local_sum + others) / denom.to(local_sum.dtype)


def sequence_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, group=None, *,
                           ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy averaged over the valid tokens of the whole SP group (exact global mean).

    logits `[B, S_local, V]` and *already shifted* labels `[B, S_local]` (from
    `shard_batch`). Computed in float32. Differentiable (see `global_mean_from_sum`).
    """
    local_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                                ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum()
    return global_mean_from_sum(local_sum, count, group)


def causal_lm_loss(model: nn.Module, batch: SequenceParallelBatch, group=None, *,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Run `model` on this rank's shard and return the global mean loss (all ranks).

    Uses the tiled LM head + loss when `patch_model(..., tiled_loss=True)` was applied
    (no `[S, vocab]` logits), the model's logits otherwise.
    """
    inputs = batch.model_inputs()
    count = (batch.labels != ignore_index).sum()
    if _is_loss_patched(model):
        out = model(**inputs, ulysses_labels=batch.labels)
        local_sum = out["loss"] if isinstance(out, dict) else out.loss
        return global_mean_from_sum(local_sum, count, group)
    out = model(**inputs)
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return sequence_parallel_loss(logits, batch.labels, group, ignore_index=ignore_index)


# ------------------------------------------------------------------------ gradients

def allreduce_gradients(model_or_params, sp_group=None, dp_group=None) -> None:
    """Reduce gradients of replicated parameters after `backward` without DDP/FSDP:
    SUM over the SP group (each rank holds the gradient of its own tokens) and MEAN over
    the DP group (each DP rank had its own batch). Gradients are flattened into one
    buffer per dtype (one collective per group and dtype).
    """
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    todo = [(sp_group, False)]  # sp_group None = the default group (package convention)
    if dp_group is not None:
        todo.append((dp_group, True))
    for group, average in todo:
        group, world, _ = resolve_group(group)
        if group is None or world == 1:
            continue
        for gs in by_dtype.values():
            flat = _flatten_dense_tensors(gs)
            dist.all_reduce(flat, group=group)
            if average:
                flat.div_(world)
            for g, r in zip(gs, _unflatten_dense_tensors(flat, gs)):
                g.copy_(r)


def apply_ddp(model: nn.Module, groups, **ddp_kwargs):
    """Wrap `model` in DDP over the whole DP x SP world, reducing gradients as
    SUM over SP and MEAN over DP (a comm hook that sums and divides by dp_size instead of
    DDP's default division by the world size). `groups` is `init_sequence_parallel(...)`'s
    result. Call `causal_lm_loss(ddp_model, ...)` as usual.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, **ddp_kwargs)
    dp_size = groups.dp_size

    def hook(state, bucket):
        buf = bucket.buffer()
        buf.div_(dp_size)
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    return ddp


def _decoder_layers(model: nn.Module) -> List[nn.Module]:
    names = getattr(model, "_no_split_modules", None) or []
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    return layers


def apply_fsdp(model: nn.Module, groups, *, shard: str = "world", reshard_after_forward: bool = True,
               mp_policy=None, layers: Optional[Sequence[nn.Module]] = None) -> nn.Module:
    """Shard `model` with FSDP2 (`fully_shard`) for DP x SP training.

    shard="world": parameters sharded across the combined DP x SP mesh (every rank holds
    1/world of each weight, as DeepSpeed combines Ulysses with ZeRO-3). shard="sp": HSDP,
    sharded inside each SP group and replicated across DP. Each decoder layer becomes an
    FSDP unit, then the root.

    Gradient reduction is set to SUM with a post-division by dp_size (not the world size):
    the SP ranks of a group see one batch and their gradients add up, the DP ranks see
    different batches and are averaged. (FSDP's default AVG over the mesh would make the
    gradient sp_size times too small; scaling the loss by sp_size is the equivalent
    alternative.) Sum-only collectives also work on gloo, which has no PREMUL_SUM.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = groups.mesh
    device_type = mesh.device_type if mesh is not None else "cpu"
    if shard == "world":
        fmesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp_sp",))
    elif shard == "sp":
        fmesh = mesh  # (dp, sp): replicate over dp, shard over sp
    else:
        raise ValueError(f"apply_fsdp: shard must be 'world' or 'sp', got {shard!r}")
    kw = dict(mesh=fmesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    units = list(layers) if layers is not None else _decoder_layers(model)
    for layer in units:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for m in [*units, model]:
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(float(groups.dp_size))
    return model


# ----------------------------------------------------------------- tiled computation

def _reparametrize(module, params: Dict[str, torch.Tensor]):
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, params)


class _TiledFunction(torch.autograd.Function):
    """Apply `run(x_tile[, aux_tile])` over sequence tiles of x (dim 1), saving only x.

    Backward recomputes each tile with the module's parameters swapped for detached
    leaves and returns the parameter gradients as ordinary outputs, so autograd
    accumulation, DDP and FSDP hooks see one gradient per parameter as usual.
    reduce: "cat" (outputs concatenated along dim 1) or "sum" (scalar outputs summed).
    """

    @staticmethod
    def forward(ctx, run, module, names, tile, reduce, x, aux, *params):
        ctx.run, ctx.module, ctx.names, ctx.tile, ctx.reduce = run, module, names, tile, reduce
        ctx.has_aux = aux is not None
        # backward recomputes under the forward's autocast state (as torch.utils.checkpoint)
        ctx.device_type = x.device.type
        ctx.autocast = torch.is_autocast_enabled(ctx.device_type)
        ctx.autocast_dtype = torch.get_autocast_dtype(ctx.device_type) if ctx.autocast else None
        ctx.save_for_backward(x, aux if aux is not None else x.new_empty(0), *params)
        S = x.shape[1]
        out = None
        for s in range(0, max(S, 1), tile):
            xt = x[:, s:s + tile]
            at = aux[:, s:s + tile] if aux is not None else None
            o = run(xt) if at is None else run(xt, at)
            if reduce == "sum":
                out = o if out is None else out + o
            else:
                if out is None:
                    out = o.new_empty((o.shape[0], S, *o.shape[2:]))
                out[:, s:s + tile] = o
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, aux, *params = ctx.saved_tensors
        aux = aux if ctx.has_aux else None
        need_x = ctx.needs_input_grad[5]
        need_p = list(ctx.needs_input_grad[7:])
        leaves = [p.detach().requires_grad_(n) for p, n in zip(params, need_p)]
        dx = torch.zeros_like(x) if need_x else None
        dps = [None] * len(params)
        S = x.shape[1]
        amp = torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype, enabled=ctx.autocast) \
            if ctx.autocast else contextlib.nullcontext()
        with torch.enable_grad(), amp, _reparametrize(ctx.module, dict(zip(ctx.names, leaves))):
            for s in range(0, max(S, 1), ctx.tile):
                xt = x[:, s:s + ctx.tile].detach().requires_grad_(need_x)
                at = aux[:, s:s + ctx.tile] if aux is not None else None
                o = ctx.run(xt) if at is None else ctx.run(xt, at)
                g = grad_out if ctx.reduce == "sum" else grad_out[:, s:s + ctx.tile]
                inputs = ([xt] if need_x else []) + [l for l in leaves if l.requires_grad]
                if not inputs:
                    continue
                got = torch.autograd.grad(o, inputs, g, allow_unused=True)
                i = 0
                if need_x:
                    if got[0] is not None:
                        dx[:, s:s + ctx.tile] = got[0]
                    i = 1
                for j, l in enumerate(leaves):
                    if l.requires_grad:
                        gj = got[i]
                        i += 1
                        if gj is not None:
                            dps[j] = gj if dps[j] is None else dps[j].add_(gj)
        return (None, None, None, None, None, dx, None, *dps)


def _named_params(module):
    names, params = [], []
    for n, p in module.named_parameters():
        names.append(n)
        params.append(p)
    return names, params


def tiled_mlp(module: nn.Module, x: torch.Tensor, tile_tokens: int, forward: Optional[Callable] = None) -> torch.Tensor:
    """`forward(x)` (default: `module`'s original forward) computed over tiles of
    `tile_tokens` positions along dim 1, without keeping the intermediates of the whole
    sequence (each tile is recomputed in backward). Exact: equals `forward(x)`, forward
    and backward. Position-wise modules only (an MLP)."""
    fwd = forward if forward is not None else getattr(module, "_ulysses_orig_forward", module.forward)
    names, params = _named_params(module)
    return _TiledFunction.apply(fwd, module, names, max(1, int(tile_tokens)), "cat", x, None, *params)


def _lm_head_run(lm_head, ignore_index, softcap):
    def run(h, labels):
        logits = lm_head(h).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=ignore_index, reduction="sum")
    return run


def tiled_cross_entropy_sum(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, *,
                            tile_tokens: int, ignore_index: int = IGNORE_INDEX,
                            final_logit_softcapping: Optional[float] = None) -> torch.Tensor:
    """Sum of the cross-entropy (float32) of `lm_head(hidden)` against shifted `labels`
    over tiles of `tile_tokens` positions: logits exist for one tile at a time, forward
    and backward (each tile is recomputed). Differentiable w.r.t. hidden and the head."""
    names, params = _named_params(lm_head)
    run = _lm_head_run(lm_head, ignore_index, final_logit_softcapping)
    labels = labels.to(hidden.device)
    return _TiledFunction.apply(run, lm_head, names, max(1, int(tile_tokens)), "sum", hidden, labels, *params)


def _is_mlp(module: nn.Module) -> bool:
    name = type(module).__name__
    if name.startswith("FSDP"):
        name = name[4:]
    return name.endswith("MLP") and not any(type(c).__name__.endswith("MLP") for c in module.children())


def _is_loss_patched(model) -> bool:
    m = getattr(model, "module", model)  # DDP
    return getattr(m, "_ulysses_tiled_loss", False)


def patch_model(model: nn.Module, *, tiled_mlp: bool = True, tiled_loss: bool = True,
                mlp_tile_tokens: Optional[int] = None, loss_tile_tokens: Optional[int] = None) -> nn.Module:
    """Patch a loaded HF causal LM (in place) for long sequences; returns it.

    tiled_mlp: every `*MLP` module runs over sequence tiles (default tile: hidden_size
    tokens), its `[S, intermediate]` activations never existing for the whole sequence.
    tiled_loss: `model(..., ulysses_labels=shifted_labels)` runs the backbone and returns
    an output whose `loss` is the *sum* of the token losses of this rank computed tile by
    tile through the LM head (default tile: ~16M logits), with `logits=None`. Use it via
    `causal_lm_loss`, which divides by the global token count. The loss is computed inside
    the model's forward, so FSDP has the head's weights gathered.

    Both are compatible with activation checkpointing (`model.gradient_checkpointing_enable()`)
    and exact (same numbers as the unpatched model up to float summation order). Apply before
    or after FSDP/DDP wrapping. `unpatch_model` reverts.
    """
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", 1024) or 1024
    vocab = getattr(cfg, "vocab_size", 32000) or 32000
    mlp_tile = int(mlp_tile_tokens or max(16, hidden))
    loss_tile = int(loss_tile_tokens or max(16, (1 << 24) // vocab))
    if tiled_mlp:
        n = 0
        for m in model.modules():
            if _is_mlp(m) and not hasattr(m, "_ulysses_orig_forward"):
                m._ulysses_orig_forward = m.forward
                m._ulysses_tile = mlp_tile
                m.forward = types.MethodType(_tiled_mlp_forward, m)
                n += 1
        if n == 0:
            raise ValueError("patch_model: found no *MLP module to tile")
    if tiled_loss and not getattr(model, "_ulysses_tiled_loss", False):
        for attr in ("logit_scale", "logits_scaling"):
            if getattr(cfg, attr, None) not in (None, 1, 1.0):
                raise ValueError(f"patch_model: tiled loss does not support config.{attr}")
        if model.get_output_embeddings() is None:
            raise ValueError("patch_model: the model has no output embeddings (LM head)")
        model._ulysses_orig_model_forward = model.forward
        model._ulysses_loss_tile = loss_tile
        model._ulysses_tiled_loss = True
        model.forward = types.MethodType(_tiled_loss_forward, model)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo `patch_model`."""
    for m in model.modules():
        if hasattr(m, "_ulysses_orig_forward"):
            del m.forward
            del m._ulysses_orig_forward
    if getattr(model, "_ulysses_tiled_loss", False):
        del model.forward
        model._ulysses_tiled_loss = False
    return model


def _tiled_mlp_forward(self, x):
    if x.dim() != 3:  # e.g. MoE experts called on [tokens, hidden]: nothing to tile along
        return self._ulysses_orig_forward(x)
    return tiled_mlp(self, x, self._ulysses_tile)


def _tiled_loss_forward(self, *args, ulysses_labels=None, **kwargs):
    if ulysses_labels is None:
        return self._ulysses_orig_model_forward(*args, **kwargs)
    if kwargs.get("labels") is not None:
        raise ValueError("tiled loss: pass the shifted labels as ulysses_labels, not labels")
    kwargs.pop("labels", None)
    kwargs.pop("logits_to_keep", None)
    backbone = getattr(self, self.base_model_prefix)
    out = backbone(*args, **kwargs)
    hidden = out[0] if not hasattr(out, "last_hidden_state") else out.last_hidden_state
    local_sum = tiled_cross_entropy_sum(
        hidden, self.get_output_embeddings(), ulysses_labels, tile_tokens=self._ulysses_loss_tile,
        final_logit_softcapping=getattr(self.config, "final_logit_softcapping", None))
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=local_sum, logits=None)
