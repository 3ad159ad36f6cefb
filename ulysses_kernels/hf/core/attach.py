"""The sequence-parallel context of one model: the groups, ring and backend its
``"ulysses"`` attention runs on, and what a forward in progress needs (the decoding cache,
the count of attention calls).

A context lives with its model: `attach_context` sets it on every submodule, so the
attention function finds it on the `module` transformers passes it, and the mask
function through the model's config. Two models on two SP groups therefore live in one
process (a policy and a reference model, a draft and its target). `register(groups)`
sets the *default* context: a model met without a context of its own gets one that
follows it, the first time the package meets the model (an entry point, or its first
forward).
"""

import weakref
from typing import Optional

from torch import nn

from ...distributed.groups import ParallelGroups
from ..context import FORWARD_INPUTS, SequenceParallelContext, context_of, default_context, set_context
from ..families.adapters import (
    adaptable_modules,
    adapted_problem,
    install_adapters,
    replaced_adapter_problem,
    uninstall_adapters,
)
from ..families.vision.vision import install_vision
from ..groups import sp_size_of
from ..model import (
    READS_LABELS,
    ForwardMarks,
    anatomy_of,
    ensure_record,
    peft_problem,
    record_of,
    refusal,
    unwrap,
)
from .guard import check_model, install_call_checks, reads_positions
from .patches import set_attribute

ATTN_IMPLEMENTATION = "ulysses"   # the name register() gives the attention (and its mask function)


def _enter_forward(module, args, kwargs):
    context = context_of(module)
    if context is None:
        return
    if context.depth == 0:   # the outermost forward: a new forward's inputs
        _check_adapters(module)
        _check_labels(module, context, kwargs)
        context.forward_inputs = {}
        context.forward_memo = {}
        context.forward_keys = set()
    elif record_of(module).marked(module, "positions_holder") and "position_ids" in context.forward_keys \
            and kwargs.get("position_ids") is None:
        raise refusal(module, f"the position_ids given to the model did not reach {type(module).__name__}, which "
                              "numbers the positions: a head on the way drops them, so each rank's tokens would be "
                              "numbered from 0 (local positions)")
    context.depth += 1
    context.forward_keys.update(k for k, v in kwargs.items() if v is not None)
    for key in FORWARD_INPUTS:
        if kwargs.get(key) is not None:
            context.forward_inputs[key] = kwargs[key]


def _check_adapters(module: nn.Module) -> None:
    """Refuse a forward in which an adapted token mixer would not run its adapted forward
    (mixers.py): the same on every rank, since every rank did the same to its model. The
    mixers under `module` are found at its first forward and kept on it."""
    record = record_of(module)
    watched = record.marked(module, "watched_mixers")
    if watched is None:
        watched = adaptable_modules(module)
        record.mark(module, "watched_mixers", watched)
    problem = replaced_adapter_problem(watched)
    if problem:
        raise refusal(module, problem)


def _check_labels(module: nn.Module, context, kwargs) -> None:
    """Refuse `labels=` given to a model on more than one rank: transformers' heads compute
    their loss from this rank's tokens (a local mean; a causal LM shifts the labels
    `shard_batch` already shifted, again). The exact losses take this rank's share of the
    whole batch's targets (`causal_lm_loss`, `sequence_parallel_loss`; the tiled loss reads
    `ulysses_labels=`)."""
    forward = vars(module).get("forward") or type(module).forward   # the instance's own, or its class's
    if forward in READS_LABELS:
        return   # the package's own forward (logprobs, patch, heads.py) reads them itself
    if kwargs.get("labels") is not None and context.sp_size > 1:
        raise refusal(module, f"labels= given to the model at {context.describe()}: its own loss would be this "
                              "rank's local mean (and a causal LM would shift the already shifted labels again)",
                      "Compute the loss with ulysses_kernels.hf.causal_lm_loss(model, batch, groups) or "
                      "sequence_parallel_loss(logits, batch.labels, group), and call the model without labels.")


def _leave_forward(module, args, kwargs, output):
    context = context_of(module)
    if context is not None and context.depth > 0:
        context.depth -= 1


def install_input_hooks(model: nn.Module) -> None:
    """Forward hooks on the model and its base models (every transformers PreTrainedModel
    inside) that keep the forward's `FORWARD_INPUTS` on the context (once per model: the
    model's record keeps them)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:   # a stand-in model: nothing to hook
        return
    record = ensure_record(model)
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not record.marked(module, "input_hooks"):
            record.add_hooks("input", [module.register_forward_pre_hook(_enter_forward, with_kwargs=True),
                                       module.register_forward_hook(_leave_forward, with_kwargs=True,
                                                                    always_call=True)])
            record.mark(module, "input_hooks")


# Configs the mask function sees -> the context of their model (transformers passes the
# mask function the config, not the model). Weak: a model's config dies with it.
_BY_CONFIG = {}


def _remember_configs(model: nn.Module, context: SequenceParallelContext) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            _BY_CONFIG[id(config)] = (weakref.ref(config), context)


def context_for_config(config) -> Optional[SequenceParallelContext]:
    entry = _BY_CONFIG.get(id(config))
    if entry is None:
        return None
    ref, context = entry
    if ref() is not config:   # the id of a config that is gone
        del _BY_CONFIG[id(config)]
        return None
    return context


def attach_context(model: nn.Module, groups=None, *, ring_group=None, backend: Optional[str] = None,
                   context: Optional[SequenceParallelContext] = None, engine=None) -> SequenceParallelContext:
    """Give `model` a sequence-parallel context of its own: its ``"ulysses"`` attention,
    mask, loss and generation then run on `groups` whatever `register` set (groups as
    for `register`: a process group or `init_sequence_parallel`'s groups). Checks the
    model first (`guard.check_model`: a model the package cannot make exactly
    sequence-parallel raises the same ValueError on every rank). `engine`: a
    `fused.Engine` the caller holds for this model (see `ulysses_attention`). Returns the
    context."""
    problem = peft_problem(model)
    if problem:
        raise refusal(unwrap(model), problem)
    model = unwrap(model)
    context = context if context is not None else SequenceParallelContext(groups, ring_group=ring_group,
                                                                          backend=backend, engine=engine)
    ensure_record(model)   # the one record of what follows (model.py's Installed)
    install_adapters(model)
    anatomy = anatomy_of(model)   # what the rules and the installers below read of the model
    try:
        check_model(anatomy)
        _, world, _ = context.ulysses()
        problem = adapted_problem(model, world, context.ring()[1])
        if problem:
            raise refusal(model, problem)
    except Exception:   # refused: the model runs as transformers wrote it
        uninstall_adapters(model)
        raise
    install_vision(anatomy)
    set_context(model, context)
    _remember_configs(model, context)
    install_input_hooks(model)
    holder = anatomy.holder
    # checked at each forward that the positions reach the module that numbers them
    if holder is not None and holder is not model and reads_positions(anatomy):
        record_of(model).mark(holder, "positions_holder")
    install_call_checks(anatomy, context)
    return context


def model_context(model: nn.Module, groups=None) -> SequenceParallelContext:
    """The context of `model` for an entry point (`causal_lm_loss`, `patch_model`, the
    Trainer mixin, `generate`): its own, or, the first time, one attached to it: on
    `init_sequence_parallel`'s groups when given, else `register`'s (also when `groups`
    is the SP group of the same size), else on `groups`. `groups` given to a model with a
    context of another SP size: a ValueError."""
    context = context_of(model)
    if context is None:
        return attach_context(model, context=_first_context(groups))
    if groups is not None:
        sp = sp_size_of(groups)
        if sp != context.sp_size and context.follows_default:   # the default moved on: this call says where
            return attach_context(model, context=_first_context(groups))
        if sp != context.sp_size:
            raise ValueError(f"ulysses_kernels.hf: the model runs on {context.describe()} (its context), but the "
                             f"call passed groups of SP size {sp}; pass the model's own groups "
                             "(ulysses_kernels.hf.context_of(model))")
    return context


def uses_ulysses_attention(model: nn.Module) -> bool:
    """The model (or its language model) was built with ``attn_implementation="ulysses"``."""
    for module in unwrap(model).modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
            return True
    return False


def sequence_parallel_model(model: nn.Module, groups=None) -> SequenceParallelContext:
    """`model_context` for an entry point that runs the model sequence-parallel (the loss,
    the Trainer mixin, generation): a model whose attention is not ``"ulysses"`` would
    attend within each rank's slice, so on more than one rank it is refused."""
    context = model_context(model, groups)
    if context.implementation_checked or context.sp_size == 1:
        return context
    if not uses_ulysses_attention(model):
        implementation = getattr(getattr(unwrap(model), "config", None), "_attn_implementation", None)
        raise refusal(unwrap(model), f"its attention implementation is {implementation!r}, which would attend "
                                     f"within each rank's slice of the sequence",
                      'Load it with attn_implementation="ulysses" (after ulysses_kernels.hf.register(groups)), or '
                      "call model.set_attn_implementation(\"ulysses\").")
    context.implementation_checked = True
    return context


_MEETING_CALLS = ForwardMarks()   # the package's PreTrainedModel.__call__ (installed once per process)


def meet_models_at_their_first_call() -> None:
    """Give transformers' `PreTrainedModel` a `__call__` that, for a model called with
    `shard_batch`'s inputs (`ulysses_seq_lens=`) and no context yet, attaches the default
    context and checks the model (`sequence_parallel_model`: the guard, and a model whose
    attention is not "ulysses" on more than one rank) before its forward starts. Without it
    the package first meets such a model inside its forward (the mask function), too late
    for what the forward already began (its head), or never (attention written by hand).
    Any other call passes through unchanged. Idempotent (`register` calls it)."""
    from transformers import PreTrainedModel

    call = PreTrainedModel.__call__
    if call in _MEETING_CALLS:
        return

    def __call__(self, *args, **kwargs):
        if kwargs.get("ulysses_seq_lens") is not None and context_of(self) is None:
            sequence_parallel_model(self)
        return call(self, *args, **kwargs)

    set_attribute(PreTrainedModel, "__call__", _MEETING_CALLS.add(__call__), "transformers.PreTrainedModel.__call__")


def _first_context(groups) -> SequenceParallelContext:
    if isinstance(groups, ParallelGroups):
        return SequenceParallelContext(groups)
    default = default_context()
    if groups is None or (default is not None and default.sp_size == sp_size_of(groups)):
        return SequenceParallelContext.following_default()
    return SequenceParallelContext(groups)


