"""Token mixers that are not attention, made sequence-parallel by heads (docs/hf_hybrids.md,
"Hybrid models"): the adapters of the linear-attention and state-space layers the guard
recognises, and what they share.

The rule is attention's (`ulysses_kernels.ulysses_head_parallel`): each of these layers
mixes tokens within a head only (a gated delta rule or a selective scan per head, a
depthwise convolution per channel), so the per-head inputs go from the sequence layout to
the head layout in one exchange, the layer runs over the whole sequence of this rank's
heads, and the output comes back. What mixes heads but not tokens (the projections, a
gated RMSNorm over a token's heads) stays on the local shard.

Packed documents: the convolution and the recurrence restart at every document boundary
of the global sequence (`document_starts`, `causal_conv1d`, `over_documents`), so a packed
row equals its documents run one by one, on one rank as on many. Under Ulysses x Ring the
state and the convolution's inputs pass from chunk to chunk of the ring (mixer_ring.py);
in generation each rank keeps its heads' states on the head-sharded cache
(`chunk_head_parallel`, hf/inference/cache.py).

An adapter gives one module instance the sequence-parallel forward (`install_adapters`,
called when the package meets a model: `attach_context`) by moving it to a subclass of its
own class (same name and module) whose forward is the adapter: an instance attribute would
not survive what transformers does to a model afterwards (since 5.25 every `train()` /
`eval()` re-runs the hub-kernel setup, which deletes a module's own `forward`), a class
does, and the subclass refuses hub kernels (`kernel_condition`), which would run the
one-device layer on the local shard. The module's kind is its subclass's (`adapted_kind`) and the guard
lets it (and its layer kind) through; every outermost forward checks that no adapted
module's forward was replaced since (`replaced_adapter_problem`). Each adapted forward
starts with `context.token_mixer_call`, which counts it as a call of the package's token mixers
(`context.attention_calls`, as the attention function does) and gives it the forward's
lengths and documents.
"""

import types
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...api import ulysses_head_parallel
from ...distributed.collectives import all_gather_tensor
from ...layout import LocalHeads, place_heads
from ..model import ensure_record, record_of

# class name -> (kind, forward, problem): filled by the adapter modules (gated_deltanet.py,
# mamba2.py) through `adapter` when the hf package imports them.
ADAPTERS: Dict[str, tuple] = {}


def adapter(kind: str, *class_names: str, problem: Optional[Callable] = None) -> Callable:
    """Register `forward(module, hidden_states, ...)` as the sequence-parallel forward of
    modules of these transformers classes; `problem(module, world)` says why a module's
    heads have no placement over `world` Ulysses ranks (None: they have)."""
    def register(forward):
        for name in class_names:
            ADAPTERS[name] = (kind, forward, problem)
        return forward
    return register


# transformers class -> its adapted subclass (one per class, so that every adapted module of
# a class shares it and `type(a) is type(b)` still holds between them), and back
_ADAPTED_CLASSES: Dict[type, type] = {}
_BASE_CLASSES: Dict[type, type] = {}


def adapted_kind(module: nn.Module) -> Optional[str]:
    """The adapter kind of an adapted module (None: not adapted)."""
    base = _BASE_CLASSES.get(type(module))
    return ADAPTERS[base.__name__][0] if base is not None else None


def original_forward(module: nn.Module):
    """The forward an adapted module ran before its adaptation (its own, or its class's):
    what the adapter runs where it has nothing to change (one rank, a refused call)."""
    own = record_of(module).marked(module, "own_forward")
    return own if own is not None else types.MethodType(_BASE_CLASSES[type(module)].forward, module)


def _refuse_hub_kernels(module: nn.Module) -> bool:
    """The `kernel_condition` of an adapted class: the `kernels` library skips a module for
    which it returns False (a hub kernel of the layer would mix the local shard only)."""
    return False


def adapted_class(base: type) -> type:
    """The subclass of `base` whose forward is its adapter (ADAPTERS), made once per class."""
    made = _ADAPTED_CLASSES.get(base)
    if made is None:
        kind, forward, _ = ADAPTERS[base.__name__]
        made = type(base.__name__, (base,), {
            "forward": forward, "kernel_condition": staticmethod(_refuse_hub_kernels),
            "__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__})
        _ADAPTED_CLASSES[base] = made
        _BASE_CLASSES[made] = base
    return made


def install_adapters(model: nn.Module) -> List[nn.Module]:
    """Give every module of a registered class its sequence-parallel forward (once per
    module; an instance forward it had is kept in the model's record, `original_forward`)."""
    adapted = []
    record = ensure_record(model)
    for module in model.modules():
        if type(module).__name__ not in ADAPTERS:
            continue
        if adapted_kind(module) is None:
            own = vars(module).pop("forward", None)   # an instance's own forward would shadow the class's
            record.mark(module, "own_forward", own)
            module.__class__ = adapted_class(type(module))
        adapted.append(module)
    return adapted


def uninstall_adapters(model: nn.Module) -> None:
    """Give every adapted module its class and forward back (a model the package refused
    must run as transformers wrote it, without sequence parallelism)."""
    for module in model.modules():
        base = _BASE_CLASSES.get(type(module))
        if base is None:
            continue
        record = record_of(module)
        own = record.marked(module, "own_forward")
        module.__class__ = base
        vars(module).pop("forward", None)
        if own is not None:
            module.forward = own
        record.unmark(module, "own_forward")


def adaptable_modules(model: nn.Module) -> List[tuple]:
    """(name, module) of every module of `model` whose class has an adapter."""
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ in ADAPTERS]


def replaced_adapter_problem(modules) -> Optional[str]:
    """Why one of `modules` ((name, module) of `adaptable_modules`) would no longer run its
    adapted forward (None: every one does): a forward set on the instance since, or its
    class changed back. Checked at every outermost forward of a model with a context, so
    that nothing done to the model after `attach_context` leaves a token mixer local."""
    for name, module in modules:
        if adapted_kind(module) is None:
            return f"{name} ({type(module).__name__}) is no longer the package's adapted class"
        if "forward" in vars(module):
            return (f"{name} ({type(module).__name__}) got a forward of its own after the package adapted it "
                    f"({vars(module)['forward']!r}), which would mix each rank's slice of the sequence only")
    return None


def adapted_problem(model: nn.Module, world: int, ring: int) -> Optional[str]:
    """Why an adapted mixer of `model` cannot run on `world` Ulysses ranks and a ring of
    `ring` (None: every one can). Deterministic: the same answer on every rank."""
    for name, module in model.named_modules():
        kind = adapted_kind(module)
        if kind is None:
            continue
        if ring > 1 and not getattr(ADAPTERS[type(module).__name__][1], "runs_on_a_ring", False):
            return (f"{name} ({type(module).__name__}) is a recurrent token mixer whose adapter does not pass its "
                    f"state across the chunks of a ring (ring size {ring}); use Ulysses only (ring_size=1)")
        problem = ADAPTERS[type(module).__name__][2]
        found = problem(module, world) if problem is not None else None
        if found:
            return f"{name} ({type(module).__name__}): {found}"
    return None


# ------------------------------------------------------------------ the forward's documents

def document_bounds(cu_seqlens, length: int) -> Optional[List[int]]:
    """The global document boundaries `[0, ..., length]` of a packed row (None: one
    document per row); ValueError when they do not cover the sequence."""
    if cu_seqlens is None:
        return None
    bounds = [int(b) for b in torch.as_tensor(cu_seqlens).reshape(-1).tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"ulysses_kernels.hf: document boundaries {bounds} must rise from 0 to the sequence length "
                         f"{length}")
    return bounds if len(bounds) > 2 else None


def document_starts(cu_seqlens, length: int, device) -> Optional[torch.Tensor]:
    """`[S]`: the global index where each position's document starts (None: one document)."""
    if cu_seqlens is None:
        return None
    bounds = torch.as_tensor(cu_seqlens, device=device).reshape(-1).to(torch.int64)
    if bounds.numel() <= 2:
        return None
    positions = torch.arange(length, device=device)
    return bounds[torch.searchsorted(bounds, positions, right=True) - 1]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  starts: Optional[torch.Tensor], activation: Optional[str],
                  history: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution of `x` `[B, S, C]` with `weight` `[C, K]`, zero history
    before each document (`starts` from `document_starts`; None: one document per row), or
    the inputs `history` `[B, K - 1, C]` before the row (generation's conv state, one
    document per row), then the activation ("silu" or None)."""
    B, S, C = x.shape
    K = weight.shape[-1]
    if history is not None:
        return causal_conv1d(torch.cat([history.to(x.dtype), x], dim=1), weight, bias, None, activation)[:, -S:]
    if starts is None:
        out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=K - 1,
                       groups=C)[:, :, :S].transpose(1, 2)
    else:
        # window tap i of position t reads position t - K + 1 + i: only inside t's document
        windows = F.pad(x.to(weight.dtype), (0, 0, K - 1, 0)).unfold(1, K, 1)           # [B, S, C, K]
        taps = torch.arange(S, device=x.device)[:, None] - (K - 1) + torch.arange(K, device=x.device)
        inside = (taps >= starts[:, None]).to(weight.dtype)                               # [S, K]
        out = (windows * (weight[None] * inside[:, None, :])).sum(-1)
        if bias is not None:
            out = out + bias
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"ulysses_kernels.hf: convolution activation {activation!r} is not supported")
    return out.to(x.dtype)


def conv_history(previous: Optional[torch.Tensor], x: torch.Tensor, kernel: int) -> torch.Tensor:
    """The last `kernel - 1` inputs `[B, K - 1, C]` of the convolution after `x` `[B, S, C]`
    (zeros before the first token): what the next chunk's convolution reads first."""
    B, _, C = x.shape
    if previous is None:
        previous = x.new_zeros(B, kernel - 1, C)
    return torch.cat([previous.to(x.dtype), x], dim=1)[:, -(kernel - 1):].detach().clone()


def chunk_head_parallel(fn: Callable, tensors: Dict[str, torch.Tensor], cache) -> torch.Tensor:
    """The head-parallel call of a token mixer inside a generation forward (hf/inference/cache.py's
    chunks): a sharded chunk (the prefill: sequence shards of the chunk) goes through
    `ulysses_head_parallel` with the chunk's lengths; a replicated chunk (decode: every rank
    holds the same tokens) takes this rank's heads of each tensor, runs `fn` on them and
    all-gathers the output heads, so every rank continues with the same hidden state."""
    group, world, rank = cache.ulysses
    if cache.chunk_lens is not None:
        return ulysses_head_parallel(fn, tensors, group, seq_lens=cache.chunk_lens)
    length = next(iter(tensors.values())).shape[1]
    heads = LocalHeads(rank, world, (length,), {name: place_heads(t.shape[2], world) for name, t in tensors.items()})
    local = {name: t[:, :, heads.heads(name).start:heads.heads(name).stop] for name, t in tensors.items()}
    return torch.cat(all_gather_tensor(fn(local, heads).contiguous(), group), dim=2)


def over_documents(fn: Callable, tensors: List[torch.Tensor], cu_seqlens) -> torch.Tensor:
    """`fn(*tensors)` on each document of a packed row (B == 1, dim 1 the sequence), the
    outputs concatenated along the sequence; on the whole row without documents."""
    bounds = document_bounds(cu_seqlens, tensors[0].shape[1])
    if bounds is None:
        return fn(*tensors)
    parts = [fn(*(t[:, start:stop] for t in tensors)) for start, stop in zip(bounds[:-1], bounds[1:]) if stop > start]
    return torch.cat(parts, dim=1)
