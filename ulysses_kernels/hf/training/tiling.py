"""Tiled computation along the sequence: an MLP, or the LM head + cross-entropy, over tiles
of positions whose intermediates (`[S, intermediate]`, `[S, vocab]` logits) never exist
for the whole local sequence; each tile is recomputed in the backward."""

import contextlib
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core.batch import IGNORE_INDEX
from ..model import record_of


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
    record = record_of(module)
    fwd = forward if forward is not None else (record.original_forward(module) if record is not None else module.forward)
    names, params = _named_params(module)
    return _TiledFunction.apply(fwd, module, names, max(1, int(tile_tokens)), "cat", x, None, *params)


def _lm_head_run(lm_head, ignore_index, softcap):
    def run(h, labels):
        logits = lm_head(h)
        logits = logits if logits.dtype == torch.float64 else logits.float()  # float32 at least
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
