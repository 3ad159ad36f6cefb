"""`patch_model`: tiled MLPs, a tiled LM head + loss and checkpoint offload on a loaded
Hugging Face causal LM."""

import types
from typing import Optional, Union

from torch import nn

from ...planner import loss_tile_tokens as default_loss_tile
from ...planner import mlp_tile_tokens as default_mlp_tile
from ..context import context_of, default_context
from ..core.attach import model_context, uses_ulysses_attention
from ..model import READS_LABELS, ensure_record, record_of, unwrap, wrapped_blocks
from . import tiling
from .offload import CheckpointOffload, enable_checkpoint_offload
from .tiling import tiled_cross_entropy_sum


def _is_mlp(module: nn.Module) -> bool:
    """A dense MLP block to tile. A mixture of experts (a block with `experts`, e.g.
    GPT-OSS's `GptOssMLP`) is not: its output carries the router's scores, and its
    activations are those of the experts each token chose, not the dense intermediate."""
    name = type(module).__name__
    if name.startswith("FSDP"):
        name = name[4:]
    return (name.endswith("MLP") and not hasattr(module, "experts")
            and not any(type(c).__name__.endswith("MLP") for c in module.children()))


def is_loss_patched(model) -> bool:
    """True when patch_model tiled the model's loss (its record keeps the tile)."""
    record = record_of(model)
    return record is not None and record.marked(unwrap(model), "loss_tile") is not None


def is_mlp_tiled(model) -> bool:
    """True when patch_model tiled the model's MLPs."""
    record = record_of(model)
    return record is not None and any(record.marked(m, "mlp_tile") is not None for m in unwrap(model).modules())


def patch_model(model: nn.Module, *, tiled_mlp: bool = True, tiled_loss: bool = True,
                mlp_tile_tokens: Optional[int] = None, loss_tile_tokens: Optional[int] = None,
                offload_checkpoints: Union[bool, CheckpointOffload] = False) -> nn.Module:
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

    offload_checkpoints: keep the inputs that each checkpointed decoder layer (but the
    last) saves in pinned host memory until the backward (`offload.CheckpointOffload`;
    pass an instance to choose its options). Needs activation checkpointing enabled first;
    exact (the same bytes come back); on CPU tensors a no-op.
    """
    if uses_ulysses_attention(model) and (context_of(model) is not None or default_context() is not None):
        model_context(model)   # the model's context, checked (guard.py) before it is patched
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", 1024) or 1024
    vocab = getattr(cfg, "vocab_size", 32000) or 32000
    mlp_tile = int(mlp_tile_tokens or default_mlp_tile(hidden))  # the planner's model uses the same defaults
    loss_tile = int(loss_tile_tokens or default_loss_tile(vocab))
    record = ensure_record(model)   # what follows is undone from it (unpatch_model)
    if tiled_mlp:
        n = 0
        for m in model.modules():
            if _is_mlp(m) and record.marked(m, "mlp_tile") is None:
                record.replace_forward(m, types.MethodType(_tiled_mlp_forward, m))
                record.mark(m, "mlp_tile", mlp_tile)
                n += 1
        if n == 0:
            raise ValueError("patch_model: found no dense *MLP module to tile (mixture-of-experts blocks "
                             "are not tiled); pass tiled_mlp=False")
    if offload_checkpoints and not record.has_hooks("offload"):
        checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x
        if checkpointing is None:
            checkpointing = getattr(model, "is_gradient_checkpointing", False)
        if not checkpointing:
            raise ValueError("patch_model: offload_checkpoints needs activation checkpointing; call "
                             "model.gradient_checkpointing_enable() first")
        offload = offload_checkpoints if isinstance(offload_checkpoints, CheckpointOffload) else CheckpointOffload()
        layers = wrapped_blocks(model)
        if len(layers) < 2:
            raise ValueError("patch_model: offload_checkpoints found fewer than 2 decoder layers")
        record.add_hooks("offload", enable_checkpoint_offload(layers, offload))
    if tiled_loss and record.marked(model, "loss_tile") is None:
        for attr in ("logit_scale", "logits_scaling"):
            if getattr(cfg, attr, None) not in (None, 1, 1.0):
                raise ValueError(f"patch_model: tiled loss does not support config.{attr}")
        if getattr(cfg, "output_router_logits", False) and getattr(cfg, "router_aux_loss_coef", 0):
            raise ValueError("patch_model: the tiled loss returns no router logits, so the MoE load-balancing "
                             "loss (config.output_router_logits) would be dropped; use tiled_loss=False or "
                             "set output_router_logits=False")
        if model.get_output_embeddings() is None:
            raise ValueError("patch_model: the model has no output embeddings (LM head)")
        record.replace_forward(model, types.MethodType(_tiled_loss_forward, model))
        record.mark(model, "loss_tile", loss_tile)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo `patch_model`: the forwards it replaced back, its offload hooks removed."""
    record = record_of(model)
    if record is None:
        return model
    for m in unwrap(model).modules():
        for name in ("mlp_tile", "loss_tile"):
            if record.marked(m, name) is not None:
                record.restore_forward(m)
                record.unmark(m, name)
    record.remove_hooks("offload")
    return model


def _tiled_mlp_forward(self, x):
    if x.dim() != 3:  # e.g. MoE experts called on [tokens, hidden]: nothing to tile along
        return record_of(self).original_forward(self)(x)
    return tiling.tiled_mlp(self, x, record_of(self).marked(self, "mlp_tile"))


def _tiled_loss_forward(self, *args, ulysses_labels=None, **kwargs):
    if ulysses_labels is None:
        return record_of(self).original_forward(self)(*args, **kwargs)
    if kwargs.get("labels") is not None:
        raise ValueError("tiled loss: pass the shifted labels as ulysses_labels, not labels")
    kwargs.pop("labels", None)
    kwargs.pop("logits_to_keep", None)
    backbone = getattr(self, self.base_model_prefix)
    out = backbone(*args, **kwargs)
    hidden = out[0] if not hasattr(out, "last_hidden_state") else out.last_hidden_state
    local_sum = tiled_cross_entropy_sum(
        hidden, self.get_output_embeddings(), ulysses_labels, tile_tokens=record_of(self).marked(self, "loss_tile"),
        final_logit_softcapping=getattr(self.config, "final_logit_softcapping", None))
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=local_sum, logits=None)


READS_LABELS.add(_tiled_loss_forward)   # it refuses labels= itself, saying what to pass
