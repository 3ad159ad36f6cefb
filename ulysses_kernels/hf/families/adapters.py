"""The token-mixer adapters (docs/hf_hybrids.md, "Hybrid models"): which transformers class
gets which sequence-parallel forward (`ADAPTERS`, written out whole), and installing them on a
model, checking them and taking them off. The forwards themselves are the families'
(gated_deltanet.py, mamba2.py, short_conv.py); what they share is mixers.py (the head
exchange's side) and halo.py (the sequence halo)."""

import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Union

from torch import nn

from ..model import ensure_record, record_of
from . import (
    block_sparse,
    cca,
    compressed,
    dsa,
    gated_deltanet,
    inkling,
    inkling2,
    kimi_delta,
    lightning,
    mamba1,
    mamba2,
    ngram,
    qsa,
    rg_lru,
    rwkv,
    short_conv,
    xlstm,
)


class Adapter(NamedTuple):
    """A token mixer's sequence-parallel forward: its kind (a layer kind the guard lets
    through), `forward(module, hidden_states, ...)` and `problem(module, world)`: why a
    module's heads have no placement over `world` Ulysses ranks (None: they have)."""
    kind: str
    forward: Callable
    problem: Optional[Callable]


def _for(classes, kind: str, forward: Callable, problem: Callable) -> Dict[str, Adapter]:
    return {name: Adapter(kind, forward, problem) for name in classes}


# transformers class name -> its adapter: the whole registry, written here (a new mixer family
# adds its line; nothing registers itself by being imported).
ADAPTERS: Dict[str, Adapter] = {
    **_for(gated_deltanet.GATED_DELTANET_CLASSES, "gated_deltanet", gated_deltanet.gated_deltanet_forward,
           gated_deltanet.placement_problem),
    **_for(mamba2.MAMBA2_CLASSES, "mamba2", mamba2.mamba2_forward, mamba2.adapter_problem),
    **_for(mamba2.FALCON_H1_CLASSES, "mamba2", mamba2.falcon_h1_forward, mamba2.adapter_problem),
    **_for(short_conv.SHORT_CONV_CLASSES, "short_conv", short_conv.short_conv_forward, None),
    **_for(cca.CCA_CLASSES, "cca", cca.cca_projection_forward, None),
    **_for(lightning.LIGHTNING_CLASSES, "lightning", lightning.lightning_forward, lightning.placement_problem),
    **_for(kimi_delta.KDA_CLASSES, "kimi_delta", kimi_delta.kimi_delta_forward, kimi_delta.placement_problem),
    **_for(mamba1.MAMBA1_CLASSES, "mamba1", mamba1.mamba1_forward, mamba1.placement_problem),
    **_for(rg_lru.RG_LRU_CLASSES, "rg_lru", rg_lru.recurrent_block_forward, None),
    **_for(rwkv.TIME_MIX_CLASSES, "rwkv", rwkv.time_mix_forward, None),
    **_for(rwkv.CHANNEL_MIX_CLASSES, "rwkv", rwkv.channel_mix_forward, None),
    **_for(xlstm.XLSTM_CLASSES, "mlstm", xlstm.xlstm_forward, xlstm.placement_problem),
    **_for(inkling.SHORT_CONV_CLASSES, "short_conv", inkling.short_conv_forward, None),
    **_for(inkling.ATTENTION_CLASSES, "inkling_attention", inkling.attention_forward, inkling.placement_problem),
    **_for(inkling2.STATIC_CONV_CLASSES, "short_conv", inkling2.static_conv_forward, None),
    **_for(inkling2.DYNAMIC_CONV_CLASSES, "short_conv", inkling2.dynamic_conv_forward, None),
    **_for(inkling2.ATTENTION_CLASSES, "inkling_attention", inkling2.attention_forward, inkling.placement_problem),
    **_for(inkling2.RESIDUAL_CLASSES, "depth_attention", inkling2.block_residual_forward, None),
    **_for(inkling2.MESSAGE_CLASSES, "depth_attention", inkling2.message_residual_forward, None),
    **_for(dsa.DSA_CLASSES, "sparse_attention", dsa.dsa_forward, None),
    **_for(dsa.SHARED_SELECTION_CLASSES, "sparse_attention", dsa.shared_selection_forward, None),
    **_for(dsa.DOTS3_CLASSES, "sparse_attention", dsa.dots3_forward, dsa.dots3_placement_problem),
    **_for(block_sparse.M3_CLASSES, "sparse_attention", block_sparse.m3_forward, block_sparse.placement_problem),
    **_for(qsa.QSA_CLASSES, "sparse_attention", qsa.qsa_forward, None),
    **_for(ngram.PLE_CLASSES, "short_conv", ngram.ple_forward, None),
    **_for(compressed.V4_CLASSES, "sparse_attention", compressed.v4_forward, None),
}


# Adapted class -> the cache class its model's forward insists on (it refuses any other
# cache: the name of a class of the model's module), or the fields it reads of its cache (a
# class of the package's): the decoding cache derives from it too (hf/inference/generation.py's
# make_cache).
OWN_CACHES: Dict[str, Union[str, type]] = {"MiniMaxLightningAttention": "MiniMaxCache",
                                           "xLSTMLayer": xlstm.XlstmCacheFields}


def own_cache_class(model: nn.Module) -> Optional[type]:
    """The cache class `model` insists on (OWN_CACHES; None: any cache)."""
    for module in model.modules():
        base = _BASE_CLASSES.get(type(module))
        own = OWN_CACHES.get(base.__name__) if base is not None else None
        if own is not None:
            return own if isinstance(own, type) else getattr(sys.modules[base.__module__], own)
    return None


# transformers class -> its adapted subclass (one per class, so that every adapted module of
# a class shares it and `type(a) is type(b)` still holds between them), and back
_ADAPTED_CLASSES: Dict[type, type] = {}
_BASE_CLASSES: Dict[type, type] = {}


def adapted_kind(module: nn.Module) -> Optional[str]:
    """The adapter kind of an adapted module (None: not adapted)."""
    base = _BASE_CLASSES.get(type(module))
    return ADAPTERS[base.__name__].kind if base is not None else None


def _refuse_hub_kernels(module: nn.Module) -> bool:
    """The `kernel_condition` of an adapted class: the `kernels` library skips a module for
    which it returns False (a hub kernel of the layer would mix the local shard only)."""
    return False


def adapted_class(base: type) -> type:
    """The subclass of `base` whose forward is its adapter (ADAPTERS), made once per class."""
    made = _ADAPTED_CLASSES.get(base)
    if made is None:
        forward = ADAPTERS[base.__name__].forward
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


def prepare_cache(model: nn.Module, cache) -> None:
    """Give a new decoding cache what `model`'s forward reads of it before its mixers run (an
    adapted forward's `prepare_cache(module, cache)`: Qwen4-Exp's indexer positions)."""
    for module in model.modules():
        if adapted_kind(module) is not None:
            prepare = getattr(ADAPTERS[type(module).__name__].forward, "prepare_cache", None)
            if prepare is not None:
                prepare(module, cache)


def adapted_problem(model: nn.Module, world: int, ring: int) -> Optional[str]:
    """Why an adapted mixer of `model` cannot run on `world` Ulysses ranks and a ring of
    `ring` (None: every one can). Deterministic: the same answer on every rank."""
    for name, module in model.named_modules():
        kind = adapted_kind(module)
        if kind is None:
            continue
        if ring > 1 and not getattr(ADAPTERS[type(module).__name__].forward, "runs_on_a_ring", False):
            return (f"{name} ({type(module).__name__}) is a token mixer whose adapter does not run across the "
                    f"chunks of a ring (ring size {ring}); use Ulysses only (ring_size=1)")
        problem = ADAPTERS[type(module).__name__].problem
        found = problem(module, world) if problem is not None else None
        if found:
            return f"{name} ({type(module).__name__}): {found}"
    return None
