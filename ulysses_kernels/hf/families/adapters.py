"""The token-mixer adapters (docs/hf_hybrids.md, "Hybrid models"): which transformers class
gets which sequence-parallel forward (`ADAPTERS`, derived from the families' declarations,
`FAMILIES`: family.py), and installing them on a model, checking them and taking them off.
The forwards themselves are the families' (gated_deltanet.py, mamba2.py, short_conv.py, ...);
what they share is mixers.py (the head exchange's side), mixer_ring.py and halo/halo.py (the
sequence halo)."""

import sys
from typing import Dict, List, Optional, Tuple

from torch import nn

from ..model import ensure_record, record_of
from .by_heads import gated_deltanet, kimi_delta, lightning, mamba2, xlstm
from .family import Adapter, Family, InterfaceAttention, protocol_forward
from .halo import cca, inkling, inkling2, mamba1, ngram, rg_lru, rwkv, short_conv
from .mixers import ADAPTED_CLASSES
from .sparse import block_sparse, compressed, dsa, qsa

# Every family module's declaration (family.py): the registry below is derived from them.
FAMILIES: Tuple[Family, ...] = (
    gated_deltanet.FAMILY, mamba2.FAMILY, short_conv.FAMILY, cca.FAMILY, lightning.FAMILY, kimi_delta.FAMILY,
    mamba1.FAMILY, rg_lru.FAMILY, rwkv.FAMILY, xlstm.FAMILY, inkling.FAMILY, inkling2.FAMILY, dsa.FAMILY,
    block_sparse.FAMILY, qsa.FAMILY, ngram.FAMILY, compressed.FAMILY,
)


def _registry(families) -> Dict[str, Adapter]:
    """transformers class name -> its adapter, each class claimed by one family only."""
    found: Dict[str, Adapter] = {}
    for family in families:
        for adapter in family.adapters:
            for name in adapter.classes:
                if name in found:
                    raise ValueError(f"{name} is adapted twice (family {family.name})")
                found[name] = adapter
    return found


ADAPTERS: Dict[str, Adapter] = _registry(FAMILIES)
# Users' declarations (`declare_family`), by family name; ADAPTERS holds their adapters too
DECLARED: Dict[str, Family] = {}


def declare_family(name: str, *declarations) -> Family:
    """Make the layers of a model the package does not know sequence-parallel (docs/hf_custom.md):
    `declarations` are `by_heads(...)` (by_heads/declared.py), `halo(...)` (halo/declared.py)
    and `interface_attention(...)` (family.py) of its layer classes. Process-wide, like
    transformers' own registries; declaring a name again replaces its declaration (for the
    modules adapted after it: `undeclare_family`). A class the package or another declaration
    adapts already, or a family name of the package's, is a ValueError. Returns the
    declaration (`undeclare_family(name)` takes it back)."""
    unknown = [d for d in declarations if not isinstance(d, (Adapter, InterfaceAttention))]
    if unknown or not declarations:
        raise ValueError(f"declare_family({name!r}, ...) takes by_heads(...), halo(...) and interface_attention(...) "
                         f"declarations, got {unknown or 'none'}")
    if name in {family.name for family in FAMILIES}:
        raise ValueError(f"{name!r} is a family of the package's own; name the declaration after your model")
    family = Family(name, tuple(d for d in declarations if isinstance(d, Adapter)),
                    tuple(c for d in declarations if isinstance(d, InterfaceAttention) for c in d.classes))
    others = tuple(f for n, f in DECLARED.items() if n != name)
    registry = _registry(FAMILIES + others + (family,))   # a class claimed twice raises here
    attention = {c for f in others for c in f.attention}
    claimed = (set(family.attention) & (attention | set(registry))) | (set(family.classes) & attention)
    if claimed:
        raise ValueError(f"{sorted(claimed)} declared twice (family {name})")
    undeclare_family(name)
    DECLARED[name] = family
    ADAPTERS.update(registry)
    return family


def undeclare_family(name: str) -> None:
    """Take back `declare_family(name, ...)` (nothing if it was not declared). A declaration
    applies to the modules adapted after it: modules adapted under it keep their adapter
    (`_ADAPTER_OF`) until they are taken off (`uninstall_adapters`)."""
    family = DECLARED.pop(name, None)
    if family is None:
        return
    for class_name in family.classes:
        ADAPTERS.pop(class_name, None)
    for base in [b for b in _ADAPTED_CLASSES if b.__name__ in family.classes]:
        del _ADAPTED_CLASSES[base]


def declared_attention(class_name: str) -> bool:
    """Whether a users' declaration names `class_name` as attention through the interface."""
    return any(class_name in family.attention for family in DECLARED.values())


def own_cache_class(model: nn.Module) -> Optional[type]:
    """The cache class `model` insists on (an adapter's `own_cache`; None: any cache)."""
    for module in model.modules():
        base = _BASE_CLASSES.get(type(module))
        own = _ADAPTER_OF[type(module)].own_cache if base is not None else None
        if own is not None:
            return own if isinstance(own, type) else getattr(sys.modules[base.__module__], own)
    return None


# transformers class -> its adapted subclass (one per class, so that every adapted module of
# a class shares it and `type(a) is type(b)` still holds between them), and back
_ADAPTED_CLASSES: Dict[type, type] = {}
_BASE_CLASSES: Dict[type, type] = {}
# adapted subclass -> the adapter it was made from (a module adapted under a users' declaration
# since taken back or replaced keeps its adapter, whatever ADAPTERS holds now)
_ADAPTER_OF: Dict[type, Adapter] = {}


def adapted_kind(module: nn.Module) -> Optional[str]:
    """The adapter kind of an adapted module (None: not adapted)."""
    adapter = _ADAPTER_OF.get(type(module))
    return adapter.kind if adapter is not None else None


def _refuse_hub_kernels(module: nn.Module) -> bool:
    """The `kernel_condition` of an adapted class: the `kernels` library skips a module for
    which it returns False (a hub kernel of the layer would mix the local shard only)."""
    return False


def adapted_class(base: type) -> type:
    """The subclass of `base` whose forward is its adapter (ADAPTERS), made once per class."""
    made = _ADAPTED_CLASSES.get(base)
    if made is None:
        adapter = ADAPTERS[base.__name__]
        forward = protocol_forward(adapter, base)
        members = adapter.members(base) if adapter.members is not None else {}
        made = type(base.__name__, (base,), {
            **members, "forward": forward, "kernel_condition": staticmethod(_refuse_hub_kernels),
            "__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__})
        _ADAPTED_CLASSES[base] = made
        _BASE_CLASSES[made] = base
        _ADAPTER_OF[made] = adapter
        ADAPTED_CLASSES.add(made)
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


def generation_problem(model: nn.Module) -> Optional[str]:
    """Why `model` cannot generate with the package's decoding cache (None: it can): a layer of
    a users' declaration, which says nothing of what the layer keeps between steps."""
    for name, module in model.named_modules():
        if adapted_kind(module) is not None and not _ADAPTER_OF[type(module)].generates:
            return (f"{name} ({type(module).__name__}) is a layer of a users' declaration, which says how it mixes "
                    "a whole sequence, not what it keeps between decoding steps")
    return None


def prepare_cache(model: nn.Module, cache) -> None:
    """Give a new decoding cache what `model`'s forward reads of it before its mixers run (an
    adapter's `prepare_cache(module, cache)`: Qwen4-Exp's indexer positions)."""
    for module in model.modules():
        if adapted_kind(module) is not None:
            prepare = _ADAPTER_OF[type(module)].prepare_cache
            if prepare is not None:
                prepare(module, cache)


def adapted_problem(model: nn.Module, world: int, ring: int) -> Optional[str]:
    """Why an adapted mixer of `model` cannot run on `world` Ulysses ranks and a ring of
    `ring` (None: every one can). Deterministic: the same answer on every rank."""
    for name, module in model.named_modules():
        kind = adapted_kind(module)
        if kind is None:
            continue
        if ring > 1 and not _ADAPTER_OF[type(module)].runs_on_a_ring:
            return (f"{name} ({type(module).__name__}) is a token mixer whose adapter does not run across the "
                    f"chunks of a ring (ring size {ring}); use Ulysses only (ring_size=1)")
        problem = _ADAPTER_OF[type(module)].problem
        found = problem(module, world) if problem is not None else None
        if found:
            return f"{name} ({type(module).__name__}): {found}"
    return None
