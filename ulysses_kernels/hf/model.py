"""What a transformers model is made of, as the package reads it: its text configs, its
decoder layers (THE rule every room uses), its vision towers, the blocks transformers keeps
whole, the model inside a wrapper; and the one error the package raises for what it cannot
make exactly sequence-parallel (docs/architecture.md, "The Hugging Face layer").

The bottom room of ``ulysses_kernels.hf``: it reads modules and configs and imports no other
room, so the guard, the families, training and generation all ask the same question here and
get the same answer.
"""

from typing import List, Optional

from torch import nn

_WHAT_TO_DO = ("Train or run it without sequence parallelism (sp_size=1), or with a model whose token mixers are "
               "all attention; docs/hf.md lists the families and why each is refused.")


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


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The decoder layers: a `ModuleList` of the model, preferring one as long as the
    (text) config's layer count, then the shallowest (a mixture of experts' list sits
    inside a layer), then the longest; never a list inside a vision tower (vision.py)."""
    config = getattr(model, "config", None)
    counts = {getattr(sub, "num_hidden_layers", None) for sub in text_configs(config)} if config is not None else set()
    towers = vision_towers(model)
    lists = [(len(m) not in counts, name.count("."), -len(m), m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0 and not any(any(m is t for t in tower.modules())
                                                                          for tower in towers)]
    if not lists:
        return []
    return list(min(lists, key=lambda entry: entry[:3])[3])


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
    """The model inside a DDP / DeepSpeed wrapper."""
    return getattr(model, "module", model)
