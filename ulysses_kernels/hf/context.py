"""The sequence-parallel context of one model and the documents of the forward in progress
(docs/architecture.md, "The Hugging Face layer").

A context holds the groups, ring and backend a model's ``"ulysses"`` attention runs on, and
what a forward in progress derived once for all its layers (the lengths of every rank, the
documents, the decoding cache). It lives with its model: `set_context` puts it on every
submodule, so the attention function and the token-mixer adapters (families/) find it on
the module transformers passes them (`context_of`). Two models on two SP groups therefore
live in one process (a policy and a reference model, a draft and its target).
`register(groups)` sets the *default* context: a model met without a context of its own gets
one that follows it (core/attach.py attaches it).

Below the families and the core: both read it, neither is imported here.
"""

import warnings
from typing import List, Optional, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..api import gather_sequence
from ..distributed.collectives import gather_ints
from ..distributed.groups import collective_device, resolve_group
from ..layout import split_lengths
from ..ring.layout import local_ranges, sp_lengths
from .groups import split_groups
from .model import ensure_record, record_of, refusal


@runtime_checkable
class DecodingCache(Protocol):
    """What a forward over the package's decoding cache (inference/cache.py's
    `HeadShardedCache`) asks of it: the attention function hands it the chunk's attention,
    a token-mixer adapter asks it for its layer's state; `chunk_lens` is every Ulysses rank's
    share of a chunk split along the sequence (None: a replicated chunk)."""

    chunk_lens: Optional[List[int]]

    def attention(self, query, key, value, scaling, causal, *, module=None, attention_chunk=None,
                  window_size=(-1, -1), softcap=0.0, sinks=None): ...

    def mixer_state(self, layer_idx: int, local_len: int) -> dict: ...


class SequenceParallelContext:
    """What one model's ``"ulysses"`` attention runs on.

    groups: a process group (pure Ulysses; None: the default group), or the
    `ParallelGroups` of `init_sequence_parallel` (Ulysses x Ring too); ring_group: the ring
    group beside a plain Ulysses group; backend: the execution path (None: automatic);
    engine: a `ulysses_kernels.fused.Engine` the caller holds for this model's fused
    attention (None: the group's default engine).
    A context made by `following_default()` has no groups of its own: it reads those of
    the default context (`register`) at every call, so registering other groups moves
    the models that never got their own.
    """

    def __init__(self, groups=None, *, ring_group=None, backend: Optional[str] = None, engine=None):
        self._group, self._ring_group = split_groups(groups, ring_group)
        self._backend = backend
        self._engine = engine
        self.follows_default = False
        self.inference_cache: Optional[DecodingCache] = None   # the cache of a prefill / decode in progress
        self.attention_calls = 0           # calls of the attention function so far (guard.py counts them)
        self.warned_local_positions = False
        self.forward_memo = {}             # what one forward derives once for all its layers
        self.forward_inputs = {}           # this forward's FORWARD_INPUTS, whatever reaches the attention
        self.forward_keys = set()          # the keywords given to this forward's transformers models
        self.depth = 0                     # nesting of the model's (and its base model's) forwards
        self.implementation_checked = False   # sequence_parallel_model found the "ulysses" attention

    @classmethod
    def following_default(cls) -> "SequenceParallelContext":
        """A model's context on whatever groups the default context has (see the class doc)."""
        require_default_context()   # refuses a multi-rank world without register()
        context = cls(None)
        context.follows_default = True
        return context

    def _source(self):
        if self.follows_default:
            return require_default_context()
        return self

    @property
    def group(self):
        """The Ulysses group (None: the default group)."""
        return self._source()._group

    @property
    def ring_group(self):
        """The ring group (None: pure Ulysses)."""
        return self._source()._ring_group

    @property
    def backend(self) -> Optional[str]:
        return self._source()._backend

    @property
    def engine(self):
        """The caller's fused engine for this model (None: the group's default one)."""
        return self._source()._engine

    def ulysses(self):
        """(group, world, rank) of the Ulysses group."""
        return resolve_group(self.group)

    def ring(self):
        """(group, world, rank) of the ring group; (None, 1, 0) without a ring."""
        return resolve_group(self.ring_group) if self.ring_group is not None else (None, 1, 0)

    def reduction_groups(self):
        """The groups a sum (or maximum) over the whole SP grid runs over, one after the
        other: the Ulysses group, then the ring group, each only when it has several ranks."""
        return [group for group, world, _ in (self.ulysses(), self.ring()) if world > 1]

    def token_ranges(self, lens):
        """The global (start, length) ranges of the (packed) sequence this rank holds, in
        local order, from every SP rank's length `lens` (zigzag with a ring)."""
        _, world, rank = self.ulysses()
        _, ring_world, ring_rank = self.ring()
        return local_ranges(sum(lens), ring_world, world, ring_rank, rank)

    @property
    def sp_size(self) -> int:
        return self.ulysses()[1] * self.ring()[1]

    def describe(self) -> str:
        _, world, _ = self.ulysses()
        _, ring, _ = self.ring()
        return f"SP {world * ring}" + (f" (Ulysses {world} x ring {ring})" if ring > 1 else "")


class _Default:
    context: Optional[SequenceParallelContext] = None   # set by register()


# What the attention function needs from a forward's inputs. transformers hands the
# model's keyword arguments down to the attention function (every family of 5.24 / 5.25 that the
# guard lets through does), but a decoder layer may drop them: the model's own forward
# hooks keep them on the context for the attention function to read
# (`install_input_hooks`).
FORWARD_INPUTS = ("ulysses_seq_lens", "ulysses_cu_seqlens", "position_ids", "ulysses_shard", "ulysses_image_blocks",
                  "ulysses_rows")


def set_default_context(context: Optional[SequenceParallelContext]) -> None:
    _Default.context = context


def default_context() -> Optional[SequenceParallelContext]:
    """The context `register` set (None: none yet)."""
    return _Default.context


def require_default_context() -> SequenceParallelContext:
    """The default context, or one on the default group in a single process; in a multi-rank
    world without `register`, a ValueError (the package does not guess a group)."""
    if _Default.context is not None:
        return _Default.context
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("ulysses attention: no sequence-parallel group set; call "
                         "ulysses_kernels.hf.register(groups) or attach_context(model, groups) "
                         "(pass None explicitly to use the whole world)")
    return SequenceParallelContext(None)


def context_of(module: nn.Module) -> Optional[SequenceParallelContext]:
    """The context attached to `module` (any submodule of an attached model), or None."""
    record = record_of(module)
    return record.context if record is not None else None


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


def cu_seqlens_from_position_ids(position_ids: torch.Tensor, device=None) -> Optional[torch.Tensor]:
    """Global document boundaries (int32 `cu_seqlens`, on `device`, default the positions')
    from global position ids.

    A document starts wherever `p[t] != p[t-1] + 1` (transformers' own rule). Returns None
    when every row is one contiguous run (no packing). Packed rows need batch size 1.
    Integer positions in host memory (a CPU tensor, as a data collator returns them) are
    read as the host array they are, so `shard_batch` reads no device value back; positions
    on an accelerator are read where they are (the decision waits for the device once).
    """
    pos = position_ids.detach()
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2:
        raise ValueError(f"position_ids must be [batch, seq], got {tuple(position_ids.shape)}")
    device = position_ids.device if device is None else device
    on_host = pos.device.type == "cpu" and not pos.dtype.is_floating_point and not pos.is_complex()
    starts = _document_starts(pos.numpy() if on_host else pos, position_ids.shape)
    if starts is None:
        return None
    idx = (torch.from_numpy(np.flatnonzero(starts)) if on_host else torch.nonzero(starts).flatten()) + 1
    bounds = torch.cat([idx.new_zeros(1), idx, idx.new_full((1,), pos.shape[1])])
    return bounds.to(dtype=torch.int32, device=device)


def _document_starts(pos, shape):
    """The rule itself, on a `[B, S]` tensor or numpy array alike: the first row's document
    starts after its first token (a bool row), or None without packing; rows of packed
    documents must all be the same (batch size 1 in effect)."""
    if pos.shape[1] <= 1:
        return None
    starts = (pos[:, 1:] - pos[:, :-1]) != 1
    if not bool(starts.any()):
        return None
    if pos.shape[0] != 1 and not bool((pos == pos[:1]).all()):
        raise ValueError("ulysses attention: packed documents (position_ids restarting) need batch size 1; got "
                         f"position_ids of shape {tuple(shape)}. Concatenate the batch into one row instead.")
    return starts[0]


def set_context(model: nn.Module, context: "SequenceParallelContext") -> None:
    """Attach `context` to `model`: its record (model.py's `Installed`, on every module) holds
    it, so `context_of` finds it from whatever module transformers hands the attention
    function or a token mixer."""
    ensure_record(model).context = context
