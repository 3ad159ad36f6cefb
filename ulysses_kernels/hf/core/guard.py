"""The guard: what the package cannot make exactly sequence-parallel raises the same
`NotSequenceParallelError` on every rank, never a result computed on a local shard
(docs/hf_families.md, "What the guard refuses").

Under sequence parallelism every rank holds a slice of the sequence. The ``"ulysses"``
attention is the one place where tokens meet across slices; anything else that mixes
tokens (a state-space or recurrent layer, linear attention, a convolution along the
sequence, attention that builds its own scores or masks) would see this rank's slice
only and be silently wrong. The rules, generic rather than a list of model names:

* **Layer kinds** (`config_problem`): per-layer type lists (`layer_types`,
  `layers_block_type`, `block_types`) may name attention kinds the attention function
  implements (`ATTENTION_LAYERS`) or per-token kinds (`TOKENWISE_LAYERS`), nothing else.
  Config fields whose feature the attention function would drop: sparse-attention
  indexers (``index_*``), bidirectional attention (``is_causal=False``), an
  ``attention_chunk_size`` without chunked layers.
* **Modules** (`module_problem`): inside the decoder layers, no convolution along the
  sequence (kernel > 1), no recurrent module, no module whose class is a sequence mixer
  of another kind (`MIXER_MARKERS`: Mamba, RWKV, LSTM, linear attention, DeltaNet, ...).
* **Calls** (`install_call_checks`): during the model's first forward every decoder
  layer of an attention kind must call the attention function; a layer that does not
  (attention written by hand, another mixer) raises at its end, before the forward
  returns. The calls are counted on the model's context.
* **Masks** (`mask_request_problem`, from the mask function): a mask overlay the model
  asks for (`or_mask_function` / `and_mask_function`), or a mask that opens later tokens
  to earlier ones (Gemma 3's bidirectional image blocks from `token_type_ids`), found by
  probing the mask function above its diagonal.

A decoder layer whose only token mixers are adapted ones (mixers.py; a model with no attention
at all, Mamba2) has no attention to call through the interface, and such a model with no
position embedding or rotary table reads no positions: the interface and position rules
have nothing to ask of it.

The structural rules are deterministic (every rank holds the same model), so every rank
raises the same error; the mask rule goes through the mask function's agreement.
"""

import inspect
import re
import sys
from typing import List, Optional

from torch import nn

from ..families.adapters import adapted_kind, declared_attention
from ..model import EXACT_HEADS, Anatomy, ensure_record, refusal, text_configs, torch_sequence_mixer, within
from .patches import set_entry

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
TOKENWISE_LAYERS = frozenset({"mlp", "moe", "dense", "sparse"})
LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types", "layer_block_types")

# CamelCase words of class names of token mixers that are not attention, matched as words
# ("Ssm" is not a word of "GptOssMLP"). Plain "Conv" is not one: transformers' GPT-2
# `Conv1D` is a linear layer; real convolutions are found as torch's Conv modules.
MIXER_MARKERS = ("Mamba", "SSM", "Ssm", "Rwkv", "RWKV", "Lstm", "LSTM", "Recurrent", "Rglru", "RGLRU",
                 "LinearAttention", "LinearAttn", "DeltaNet", "DeltaAttention", "ShortConv", "CausalConv", "Retention", "Hyena",
                 "Lightning", "Indexer")
_CAMEL_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z][a-z0-9]*|[a-z0-9]+")


# ----------------------------------------------------------------------------- configs


def _layer_kinds(config):
    for field in LAYER_TYPE_FIELDS:
        kinds = getattr(config, field, None)
        if isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
            yield field, list(kinds)


def config_problem(config, adapted_kinds=frozenset(), indexed: bool = False) -> Optional[str]:
    """What the config asks for that the attention function (and the token-mixer adapters
    of `adapted_kinds`' layers, mixers.py) cannot honour, or None. `indexed`: the model's
    sparse attention runs the package's adapter (families/sparse/dsa.py), which honours its indexer."""
    for sub in text_configs(config):
        for field, kinds in _layer_kinds(sub):
            other = sorted(set(kinds) - ATTENTION_LAYERS - TOKENWISE_LAYERS - set(adapted_kinds))
            if other:
                return (f"config.{field} has layers of kind {', '.join(repr(k) for k in other)}: a token mixer that "
                        "is not attention would run on this rank's slice of the sequence only")
        indexer = sorted(k for k, v in vars(sub).items() if (k.startswith("index_") or k.startswith("indexer_"))
                         and v not in (None, False, 0, [], ()))
        if indexer and not indexed:
            return (f"a sparse-attention indexer (config.{indexer[0]}) picks keys for each query from scores and a "
                    "mask over the whole sequence, which this rank does not hold")
        if getattr(sub, "is_causal", True) is False:
            return "config.is_causal=False asks for bidirectional attention, which the causal LM loss does not define"
        chunk = getattr(sub, "attention_chunk_size", None)
        kinds = dict(_layer_kinds(sub)).get("layer_types", [])
        if chunk and "chunked_attention" not in kinds:
            return ("config.attention_chunk_size is set but no layer is of kind 'chunked_attention', so which "
                    "layers are chunked is not known")
    return None


# ----------------------------------------------------------------------------- modules


# Class names that end in a per-token role: a model named after a mixer names its MLP after
# itself too (xLSTM's `xLSTMFeedForward`), and the role, not the prefix, says what it does.
PER_TOKEN_ROLES = ("FeedForward", "MLP", "Mlp", "Norm", "Embedding", "Embeddings", "Experts")


def _names_a_mixer(class_name: str) -> bool:
    """A marker is a run of whole CamelCase words of the class name (not one that ends in a
    per-token role)."""
    if class_name.endswith(PER_TOKEN_ROLES):
        return False
    words = _CAMEL_WORD.findall(class_name)
    joined = ["".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, min(len(words), i + 3) + 1)]
    return any(marker in joined for marker in MIXER_MARKERS)


def _calls_the_attention_interface(cls: type) -> bool:
    """The class's forward looks its attention up in transformers' interface (Kimi Linear's MLA
    `KimiLinearAttention`, named after its model): attention, whatever its name says; the
    call check confirms it at the model's first forward."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def module_problem(anatomy: Anatomy) -> Optional[str]:
    """The first module inside the decoder layers that mixes tokens without attention, or None."""
    for index, layer in enumerate(anatomy.layers):
        adapted = [name for name, module in layer.named_modules() if adapted_kind(module)]
        for name, module in layer.named_modules():
            if any(name == a or name.startswith(a + ".") for a in adapted):   # made sequence-parallel (mixers.py)
                continue
            # A module holding an adapted mixer is named after it (Zamba2's `Zamba2MambaDecoderLayer`
            # around its adapted `Zamba2MambaMixer`), and a decoder layer after its model
            # (RecurrentGemma's attention layers are `RecurrentGemmaDecoderLayer`s): their names
            # say nothing of their own forward, whose convolutions and recurrent modules are still
            # checked (and a layer's attention calls, at the first forward: `install_call_checks`).
            holds_adapted = name == "" or any(a.startswith(name + ".") for a in adapted)
            cls = type(module).__name__
            what = torch_sequence_mixer(module)
            if not what and _names_a_mixer(cls) and not holds_adapted and not declared_attention(cls) \
                    and not _calls_the_attention_interface(type(module)):
                what = f"a token mixer that is not attention ({cls})"
            if what:
                where = f"decoder layer {index}" + (f", {name}" if name else "")
                return f"{where} holds {what}, which would run on this rank's slice of the sequence only"
    return None


def interface_problem(anatomy: Anatomy) -> Optional[str]:
    """A decoder layer defined in a transformers modeling file that does not even import
    the attention interface cannot call the registered function: its attention is
    written by hand (found before the forward, which such models often break on the
    mask they do not get)."""
    for layer in anatomy.layers:
        namespace = sys.modules.get(type(layer).__module__)
        if _mixes_by_adapted_mixers_only(layer):   # Mamba2's blocks: no attention to call
            continue
        if type(layer).__module__.startswith("transformers.models.") and namespace is not None \
                and not hasattr(namespace, "ALL_ATTENTION_FUNCTIONS"):
            return (f"its attention ({type(layer).__name__}) is written by hand, not through transformers' "
                    "attention interface, so each rank would attend within its own slice")
    return None


def _mixes_by_adapted_mixers_only(layer: nn.Module) -> bool:
    """A decoder layer holding an adapted token mixer (mixers.py) and no other module named
    as attention: a layer of a model with no attention (Mamba2's `Mamba2Block`), which the
    interface rule has nothing to ask of."""
    modules = list(layer.modules())
    if not any(adapted_kind(m) for m in modules):
        return False
    inside = [m for a in modules if adapted_kind(a) for m in a.modules()]
    return not any(re.search(r"Attention|Attn", type(m).__name__) for m in modules
                   if not any(m is i for i in inside))


def reads_positions(anatomy: Anatomy) -> bool:
    """Whether the model may read token positions. Only a model with no attention at all (every
    decoder layer mixes tokens by adapted mixers only: Mamba2) and nothing named as a
    position embedding or rotary table is known not to; any other may number them in code
    (ALiBi, a local `arange`), so the position rules hold for it."""
    layers = anatomy.layers
    if not layers or not all(_mixes_by_adapted_mixers_only(layer) for layer in layers):
        return True
    return any(re.search(r"Position|Positional|Rotary|Rope|RoPE", type(m).__name__)
               or ("pos" in name.rsplit(".", 1)[-1] and isinstance(m, nn.Embedding))
               for name, m in anatomy.model.named_modules())


def _takes(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return True


def position_problem(anatomy: Anatomy) -> Optional[str]:
    """Positions the model numbers itself from local indices: the innermost transformers
    model holding the input embedding takes no `position_ids` (it counts `arange` over
    this rank's slice, as BART's decoder does), or its position embedding counts from a
    padding index (RoBERTa's `padding_idx + 1 + ...`, which `shard_batch`'s global
    positions do not follow)."""
    get = getattr(anatomy.model, "get_input_embeddings", None)
    if (get() if callable(get) else None) is None:
        return None
    holder = anatomy.holder
    if holder is not None and not _takes(holder, "position_ids") and reads_positions(anatomy):
        return (f"{type(holder).__name__}.forward takes no position_ids: it numbers each rank's tokens from 0 "
                "(local positions)")
    for name, module in anatomy.model.named_modules():
        if "position" in name.rsplit(".", 1)[-1] and isinstance(module, nn.Embedding) and module.padding_idx is not None:
            return (f"{name} numbers positions from its padding index ({module.padding_idx} + 1, RoBERTa's "
                    "convention), not from the global positions shard_batch passes")
    return None


# Heads that pool over the sequence or read positions across it (a row's last token, a span's
# start and end, the first token): on a sequence shard each rank would pool its own slice of
# the packed sequence, one value per rank instead of one per row.
POOLING_HEADS = ("ForSequenceClassification", "ForQuestionAnswering", "ForMultipleChoice",
                 "ForNextSentencePrediction", "ForPreTraining")


def head_problem(anatomy: Anatomy) -> Optional[str]:
    """Why the model's head or a pooler in its text model reads across the sequence (None:
    every head it has is per token). Vision towers run whole images on each rank (vision.py):
    their poolers are theirs."""
    model = anatomy.model
    name = type(model).__name__
    suffix = next((s for s in POOLING_HEADS if name.endswith(s)), None)
    if suffix is not None and type(model).forward not in EXACT_HEADS:   # heads.py's
        return (f"its head ({name}) pools over the sequence: each rank would pool its own slice of the packed "
                "sequence, one value per rank instead of one per row")
    for sub_name, module in model.named_modules():
        if type(module).__name__.endswith("Pooler") and not any(within(module, tower) for tower in anatomy.towers):
            return (f"{sub_name} ({type(module).__name__}) pools the sequence (its first token): each rank would "
                    "pool its own slice")
    return None


def adapted_layer_kinds(anatomy: Anatomy) -> frozenset:
    """The layer kinds (config `layer_types`, one per decoder layer) whose every layer holds
    a token mixer made sequence-parallel by an adapter (mixers.py); what else such a layer
    holds is still checked by `module_problem`."""
    layers = anatomy.layers
    config = getattr(anatomy.model, "config", None)
    adapted = [any(adapted_kind(m) for m in layer.modules()) for layer in layers]
    kinds = set()
    for sub in text_configs(config) if config is not None else []:
        for _, listed in _layer_kinds(sub):
            if not layers:
                continue
            # one kind per layer, or a pattern the layers repeat (RecurrentGemma's `block_types`)
            per_layer = listed if len(listed) == len(layers) else \
                [listed[i % len(listed)] for i in range(len(layers))]
            for kind in set(per_layer):
                if all(adapted[i] for i, k in enumerate(per_layer) if k == kind):
                    kinds.add(kind)
    return frozenset(kinds)


def check_model(anatomy: Anatomy) -> None:
    """Raise `NotSequenceParallelError` when the model's structure cannot be made exactly
    sequence-parallel (config, interface, position and module rules); the calls are
    checked at its first forward. The token mixers the package adapts (mixers.py,
    `install_adapters`, which runs first) and their layer kinds pass."""
    model = anatomy.model
    config = getattr(model, "config", None)
    indexed = any(adapted_kind(m) == "sparse_attention" for m in model.modules())
    problem = ((config_problem(config, adapted_layer_kinds(anatomy), indexed) if config is not None else None)
               or head_problem(anatomy) or interface_problem(anatomy) or position_problem(anatomy)
               or module_problem(anatomy))
    if problem:
        raise refusal(model, problem)


# ------------------------------------------------------------------------------- calls

def attention_layer_flags(model: nn.Module, layers: List[nn.Module]) -> List[bool]:
    """Which decoder layers must call the attention function: all, but those that the
    config's `layer_types` (when it has one entry per layer) says are per-token."""
    config = getattr(model, "config", None)
    for sub in text_configs(config) if config is not None else []:
        kinds = dict(_layer_kinds(sub)).get("layer_types")
        if kinds is not None and len(kinds) == len(layers):
            return [kind not in TOKENWISE_LAYERS for kind in kinds]
    return [True] * len(layers)


def install_call_checks(anatomy: Anatomy, context) -> None:
    """Hooks on the decoder layers for the model's first forward: a layer that must attend
    and made no call of the attention function raises at its end; the last layer removes
    the hooks."""
    model, layers = anatomy.model, anatomy.layers
    record = ensure_record(model)
    record.remove_hooks("call_checks")   # a context attached again: its checks only
    if not layers:
        return
    flags = attention_layer_flags(model, layers)
    started = {}

    def remove():
        record.remove_hooks("call_checks")

    def before(index):
        def hook(module, args):
            started[index] = context.attention_calls
        return hook

    def after(index, must_attend):
        def hook(module, args, output):
            if must_attend and context.attention_calls == started.get(index, context.attention_calls):
                remove()
                raise refusal(model, f"decoder layer {index} ({type(module).__name__}) ran without calling the "
                                     "attention function: its attention does not go through transformers' "
                                     "attention interface, or its token mixer is not attention, and it would "
                                     "attend within this rank's slice only")
            if index == len(layers) - 1:
                remove()
        return hook

    for index, (layer, must_attend) in enumerate(zip(layers, flags)):
        record.add_hooks("call_checks", [layer.register_forward_pre_hook(before(index)),
                                         layer.register_forward_hook(after(index, must_attend))])


# ---------------------------------------------------------------- own attention tables

# transformers modeling files of causal LM families that pick their attention class from a
# table of their own, keyed by attn_implementation (a KeyError at load time for any other
# name). tests/hf/core/test_hf_guard.py checks that this covers the installed transformers.
# Falcon's is in transformers 5.24 only: 5.25 moved falcon to the attention interface.
OWN_ATTENTION_TABLES = {"falcon": "FALCON_ATTENTION_CLASSES", "git": "GIT_SELF_ATTENTION_CLASSES",
                        "gpt_neo": "GPT_NEO_ATTENTION_CLASSES"}


def refuse_in_own_attention_tables(name: str) -> None:
    """Give those tables an entry `name` whose construction raises our refusal, so that
    loading such a model with attn_implementation=name says why at once."""
    import importlib

    for family, table in OWN_ATTENTION_TABLES.items():
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:   # another transformers: nothing to do for it
            continue
        classes = getattr(module, table, None)
        if isinstance(classes, dict) and name not in classes:
            set_entry(classes, name, _refusing_attention(family, table), f"{module.__name__}.{table}[{name!r}]")


def _refusing_attention(family: str, table: str):
    what = (f"model_type {family!r} picks its attention class from a table of its own ({table}); its attention is "
            "written by hand, not through transformers' attention interface, so each rank would attend within its "
            "own slice")

    class RefusedAttention(nn.Module):
        def __init__(self, *args, **kwargs):
            raise refusal(None, what)

    return RefusedAttention
