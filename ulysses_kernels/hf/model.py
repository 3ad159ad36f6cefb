"""What a transformers model is made of, as the package reads it: its text configs, its
decoder layers (THE rule every room uses), its vision towers, the module that numbers its
positions (the three found once per model: `Anatomy`), the blocks transformers keeps
whole, the model inside a wrapper; the one error the package raises for what it cannot
make exactly sequence-parallel; and the one record of what the package installed on a model
(`Installed`: its context, the forwards it replaced, its hooks and marks), so that every
change is found, and undone, in one place (docs/architecture.md, "The Hugging Face layer").

The bottom room of ``ulysses_kernels.hf``: it reads modules and configs and imports no other
room, so the guard, the families, training and generation all ask the same question here and
get the same answer.
"""

import contextlib
import types
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

_WHAT_TO_DO = ("Train or run it without sequence parallelism (sp_size=1), or with a model whose token mixers are "
               "all attention; docs/hf_families.md lists the families and why each is refused.")


class NotSequenceParallelError(ValueError):
    """The model (or a forward's mask or option) cannot be made exactly sequence-parallel
    by ulysses_kernels; raised the same on every rank."""


def refusal(model: Optional[nn.Module], what: str, todo: str = _WHAT_TO_DO) -> NotSequenceParallelError:
    """The error naming the model's class and type, what cannot be made exact and what to do."""
    if model is None:
        return NotSequenceParallelError(f"ulysses_kernels.hf: {what}. {todo}")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "?")
    return NotSequenceParallelError(f"ulysses_kernels.hf: {type(model).__name__} (model_type {model_type!r}) cannot "
                                    f"run sequence-parallel exactly: {what}. {todo}")


def text_configs(config) -> List[object]:
    """The config and its sub-configs that describe decoder layers (a VLM's text_config)."""
    found = [config]
    for key in ("text_config", "language_config", "llm_config", "decoder_config"):
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict") and sub is not config:
            found.append(sub)
    return found


def is_vision_config(config) -> bool:
    return config is not None and "Vision" in type(config).__name__


def vision_towers(model: nn.Module) -> List[nn.Module]:
    """The model's vision encoders (outermost only): transformers models inside it whose
    config is a vision config (Qwen's `visual`, Gemma 3's SigLIP `vision_tower`)."""
    towers = []
    for name, module in model.named_modules():
        if module is model or not hasattr(module, "base_model_prefix") or not is_vision_config(getattr(module, "config", None)):
            continue
        if not any(module is t or within(module, t) for t in towers):
            towers.append(module)
    return towers


def within(module: nn.Module, tower: nn.Module) -> bool:
    """`module` is `tower` or one of its submodules."""
    return any(m is module for m in tower.modules())


def decoder_layers(model: nn.Module, towers: Optional[List[nn.Module]] = None) -> List[nn.Module]:
    """The decoder layers: a `ModuleList` of the model, preferring one as long as the
    (text) config's layer count, then the shallowest (a mixture of experts' list sits
    inside a layer), then the longest; never a list inside a vision tower (vision.py;
    `towers`: the model's, when already found)."""
    config = getattr(model, "config", None)
    counts = {getattr(sub, "num_hidden_layers", None) for sub in text_configs(config)} if config is not None else set()
    towers = vision_towers(model) if towers is None else towers
    lists = [(len(m) not in counts, name.count("."), -len(m), m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0 and not any(any(m is t for t in tower.modules())
                                                                          for tower in towers)]
    if not lists:
        return []
    return list(min(lists, key=lambda entry: entry[:3])[3])


def torch_sequence_mixer(module: nn.Module) -> Optional[str]:
    """What of torch's own modules mixes tokens along the sequence (None: `module` does not):
    a convolution of kernel > 1 (1-D: along the sequence; 2-D / 3-D: any), a token shift
    (a ZeroPad2d padding the sequence: RWKV's `time_shift`), a recurrent module."""
    name = type(module).__name__
    if isinstance(module, nn.ZeroPad2d) and any(module.padding[2:]):
        return f"a convolution or token shift along the sequence ({name}, padding {tuple(module.padding)})"
    if (isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1) or \
            (isinstance(module, (nn.Conv2d, nn.Conv3d)) and any(k > 1 for k in module.kernel_size)):
        return f"a convolution or token shift along the sequence ({name}, kernel {tuple(module.kernel_size)})"
    if isinstance(module, nn.RNNBase):
        return f"a recurrent module ({name})"
    return None


def positions_holder(model: nn.Module) -> Optional[nn.Module]:
    """The innermost transformers model holding the input embedding: the one that numbers
    the positions (None: no input embedding)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if embedding is None:
        return None
    holder = None
    for module in model.modules():   # outer to inner: the last transformers model holding it
        if hasattr(module, "base_model_prefix") and hasattr(module, "config") \
                and any(m is embedding for m in module.modules()):
            holder = module
    return holder


@dataclass(frozen=True)
class Anatomy:
    """What the guard's rules and the installers read of a model, found once when the package
    meets it (`attach_context`) and handed to each of them: the model, its decoder layers, its
    vision towers and the module that numbers its positions (None: no input embedding)."""
    model: nn.Module
    layers: List[nn.Module]
    towers: List[nn.Module]
    holder: Optional[nn.Module]


def anatomy_of(model: nn.Module) -> Anatomy:
    towers = vision_towers(model)
    return Anatomy(model, decoder_layers(model, towers), towers, positions_holder(model))


def wrapped_blocks(model: nn.Module) -> List[nn.Module]:
    """The blocks transformers keeps whole (`_no_split_modules`: decoder layers and vision
    blocks alike), else every `...DecoderLayer`: FSDP's units and the checkpointed blocks
    whose saved activations the offload moves. Not the decoder layers (`decoder_layers`):
    a VLM's vision blocks are blocks, not decoder layers."""
    names = getattr(model, "_no_split_modules", None) or []
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    return layers


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a DDP / DeepSpeed wrapper and a PEFT model. PEFT's
    layer adapters (LoRA, DoRA, LoRA on embeddings, IA3, ...) live inside that model's own
    modules and run in its forward, so what the package installs there sees them; PEFT's
    own wrappers only pass the call down (`peft_problem` refuses the adapters that do more)."""
    model = getattr(model, "module", model)
    if is_peft_model(model):
        model = model.get_base_model()
    return model


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT `PeftModel` (told by what it has, so peft need not be imported)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def peft_problem(model: nn.Module) -> Optional[str]:
    """Why a PEFT model's adapters cannot run sequence-parallel exactly (None: they can, or
    it is no PEFT model). Prompt learning (prompt / prefix / P-tuning, multitask prompts)
    prepends virtual tokens or past keys to the whole sequence in PEFT's own forward: on a
    rank's slice they would be prepended to every slice."""
    model = getattr(model, "module", model)
    if not is_peft_model(model):
        return None
    prompt = sorted(name for name, config in model.peft_config.items() if getattr(config, "is_prompt_learning", False))
    if prompt:
        kinds = sorted({str(getattr(model.peft_config[n], "peft_type", "?")).split(".")[-1] for n in prompt})
        return (f"its PEFT adapters {prompt} are prompt learning ({', '.join(kinds)}), which prepends virtual "
                "tokens to the whole sequence; layer adapters (LoRA, DoRA, IA3, ...) are exact")
    return None


# ------------------------------------------------------------------ what the package installed

_ATTRIBUTE = "_ulysses_record"   # the one attribute the package sets on a model's modules


class Installed:
    """The one record of what the package installed on one model (docs/architecture.md,
    "The Hugging Face layer"): its context, the forwards it replaced (undoable), the hooks it
    registered and the marks it keeps on modules (a tower's attention is local, the module that
    numbers positions, a patch's tile). Every module of the model carries the same record (one
    plain attribute, not a submodule), so what runs on any of them finds it."""

    def __init__(self):
        self.context = None   # the model's SequenceParallelContext (context.py), once attached
        self._forwards: Dict[nn.Module, Optional[Callable]] = {}   # module -> its own forward before
        self._hooks: Dict[str, list] = {}                          # purpose -> handles
        self._marks: Dict[Tuple[nn.Module, str], object] = {}

    # forwards: one way of replacing one, and of putting it back
    def replace_forward(self, module: nn.Module, forward: Callable) -> None:
        """`module.forward` is `forward` (bound) from now on; the forward it had is kept."""
        if module not in self._forwards:
            self._forwards[module] = vars(module).get("forward")
        module.forward = forward

    def original_forward(self, module: nn.Module) -> Callable:
        """The forward `module` ran before the package replaced it (its own, or its class's)."""
        own = self._forwards.get(module, vars(module).get("forward"))
        return own if own is not None else types.MethodType(type(module).forward, module)

    def replaced(self, module: nn.Module) -> bool:
        return module in self._forwards

    def restore_forward(self, module: nn.Module) -> None:
        if module not in self._forwards:
            return
        own = self._forwards.pop(module)
        vars(module).pop("forward", None)
        if own is not None:
            module.forward = own

    # hooks, by purpose
    def add_hooks(self, purpose: str, handles) -> None:
        self._hooks.setdefault(purpose, []).extend(handles)

    def remove_hooks(self, purpose: str) -> None:
        for handle in self._hooks.pop(purpose, []):
            handle.remove()

    def has_hooks(self, purpose: str) -> bool:
        return bool(self._hooks.get(purpose))

    # marks on modules
    def mark(self, module: nn.Module, name: str, value=True) -> None:
        self._marks[(module, name)] = value

    def marked(self, module: nn.Module, name: str, default=None):
        return self._marks.get((module, name), default)

    def unmark(self, module: nn.Module, name: str) -> None:
        self._marks.pop((module, name), None)

    def adopt(self, other: "Installed") -> None:
        """Take over what another record holds (a submodule's model attached before its whole)."""
        for module, own in other._forwards.items():
            self._forwards.setdefault(module, own)
        for purpose, handles in other._hooks.items():
            self._hooks.setdefault(purpose, []).extend(handles)
        for key, value in other._marks.items():
            self._marks.setdefault(key, value)


def record_of(module: nn.Module) -> Optional[Installed]:
    """The record of the model `module` belongs to (None: the package installed nothing)."""
    return getattr(unwrap(module), _ATTRIBUTE, None)


def ensure_record(model: nn.Module) -> Installed:
    """The record of `model`, made and put on every module the first time; a module that
    joined since, or carries the record of a model inside this one, gets this one."""
    model = unwrap(model)
    record = record_of(model) or Installed()
    for module in model.modules():
        other = vars(module).get(_ATTRIBUTE)
        if other is not record:
            if other is not None:
                record.adopt(other)
            object.__setattr__(module, _ATTRIBUTE, record)
    return record


@contextlib.contextmanager
def forward_replaced(module: nn.Module, forward: Callable, *, reads_labels: bool = False):
    """Within: `module.forward` is `forward` (a function of `(self, *args, **kwargs)`), for the
    calls that go through `module.__call__` (a DDP / FSDP wrapper's included); after: the
    forward it had (an instance attribute, such as TRL's fused head or `patch_model`'s, or its
    class's). The temporary counterpart of `Installed.replace_forward`. `reads_labels`: the
    forward reads `labels=` itself (`READS_LABELS`)."""
    if reads_labels:
        READS_LABELS.add(forward)
    had_own = "forward" in vars(module)
    previous = vars(module).get("forward")
    module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        if had_own:
            module.forward = previous
        else:
            del module.forward


class ForwardMarks:
    """A set of the package's own forward functions, by what they do (weak: a forward that
    is gone leaves it). `forward in marks` also takes a bound method."""

    def __init__(self):
        self._functions = weakref.WeakSet()

    def add(self, forward: Callable) -> Callable:
        self._functions.add(getattr(forward, "__func__", forward))
        return forward

    def __contains__(self, forward) -> bool:
        try:
            return getattr(forward, "__func__", forward) in self._functions
        except TypeError:   # not weakly referable: not one of ours
            return False


READS_LABELS = ForwardMarks()   # forwards that read labels= themselves (core/attach.py lets them through)
EXACT_HEADS = ForwardMarks()    # transformers' generic heads made exact (core/heads.py; core/guard.py lets them through)
