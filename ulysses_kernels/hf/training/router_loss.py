"""A mixture of experts' load-balancing loss as its own family computes it, over the whole
sequence of the SP group (docs/hf_training.md, "MoE and transformers' DistributedConfig").

A family that returns router logits (`output_router_logits=True`) adds, in its own forward,
`coefficient x load_balancing_loss_func(router_logits, num_experts, top_k)`, reading the three
from attributes of its causal-LM module (Mixtral: `config.num_local_experts`; DBRX:
`ffn_config.moe_num_experts` and `moe_loss_weight`; JetMoE: `aux_loss_coef`). The package's
losses compute that loss over the group's tokens (`router_aux_loss`), so they read the same
attributes, and check once per family that its `load_balancing_loss_func` is the function
`router_aux_loss` computes: a family with another one (Doge's, Switch Transformers') is
refused with the same error on every rank, never given a different loss."""

import sys
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.groups import collective_device, resolve_group
from ..groups import sp_group_of
from ..model import refusal, unwrap

COEFFICIENT_ATTRS = ("router_aux_loss_coef", "aux_loss_coef")   # the causal-LM module's, as its forward reads
_CHECKED: Dict[type, Optional[str]] = {}   # a family's class -> why its function is not router_aux_loss's


@dataclass(frozen=True)
class RouterLoss:
    """The terms a family's forward gives its load-balancing loss."""
    num_experts: int
    top_k: int
    coefficient: float


def router_aux_loss(router_logits, num_experts: int, top_k: int, group=None, *, local: bool = False) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss (transformers' `load_balancing_loss_func`
    without a mask) over the tokens of the whole SP group: `E * sum_e f_e * P_e`, f_e the
    fraction of top-k assignments and P_e the mean router probability of expert e over
    every token and layer. Both are means over the group, so each rank's sums are
    all-reduced (one collective); the value is the single-device loss on every rank and
    the gradient flows through this rank's probabilities (the assignment counts are
    constants), so the SP sum of the ranks' gradients is the full gradient. local: over these
    logits alone (one process's loss; no collective)."""
    group, world, _ = (None, 1, 0) if local else resolve_group(sp_group_of(group))
    counts, probs, rows = 0.0, 0.0, 0
    for layer in router_logits:
        p = torch.softmax(layer if layer.dtype == torch.float64 else layer.float(), dim=-1)   # as the loss's logits
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.bincount(chosen, minlength=num_experts).to(p.dtype)
        probs = probs + p.sum(dim=0)
        rows += p.shape[0]
    sums = torch.cat([counts.detach(), probs.detach(), probs.new_tensor([rows])]).double()
    if group is not None and world > 1:
        shared = sums.to(collective_device(group))
        dist.all_reduce(shared, group=group)
        sums = shared.to(probs.device)
    total_counts, total_probs, total_rows = sums[:num_experts], sums[num_experts:-1], sums[-1].clamp(min=1)
    probs_all = probs + (total_probs - probs.detach().double()).to(probs.dtype)  # value global, gradient local
    return num_experts * (total_counts.to(probs.dtype) * probs_all).sum() / total_rows.to(probs.dtype) ** 2


def router_loss_of(model: nn.Module) -> Optional[RouterLoss]:
    """The load-balancing loss terms of `model`, a model that returned router logits (None:
    its coefficient is 0 or unset, so its forward adds none); NotSequenceParallelError when
    its family's loss is not the one `router_aux_loss` computes."""
    inner = unwrap(model)
    config = _decoder_config(getattr(inner, "config", None))
    coefficient = next((getattr(inner, name) for name in COEFFICIENT_ATTRS if hasattr(inner, name)),
                       getattr(config, "router_aux_loss_coef", None))
    if not coefficient:
        return None
    experts = (getattr(inner, "num_experts", None) or getattr(config, "num_local_experts", None)
               or getattr(config, "num_experts", None))
    top_k = getattr(inner, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
    problem = _function_problem(inner, experts, top_k)
    if problem:
        raise refusal(inner, problem, "Train it with output_router_logits=False (no load-balancing loss), or "
                                      "without sequence parallelism.")
    return RouterLoss(int(experts), int(top_k), float(coefficient))


def _decoder_config(config):
    """The config a family's forward reads its loss terms from where its module has none of
    its own: a vision-language model's text config (Qwen3.5-MoE, Qwen3-VL-MoE, GLM-4.5V, ...:
    `self.config.text_config.router_aux_loss_coef`), else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def _function_problem(model: nn.Module, experts, top_k) -> Optional[str]:
    """Why the family's `load_balancing_loss_func` is not `router_aux_loss`'s (None: it is),
    checked once per class on the same fixed logits on every rank (no collective)."""
    cls = type(model)
    if cls not in _CHECKED:
        _CHECKED[cls] = _compare(_family_module(cls), experts, top_k)
    return _CHECKED[cls]


def _family_module(cls: type):
    """The modeling module of the family `cls` is (or wraps: FSDP2 makes a subclass of the
    model's class in its own module): the first class of its MRO whose module defines a
    load-balancing loss, else the class's own module."""
    for base in cls.__mro__:
        module = sys.modules.get(base.__module__)
        if hasattr(module, "load_balancing_loss_func"):
            return module
    return sys.modules.get(cls.__module__)


def _compare(module, experts, top_k) -> Optional[str]:
    own = getattr(module, "load_balancing_loss_func", None)
    if own is None or not isinstance(experts, int) or not isinstance(top_k, int):
        return ("it returns router logits, but the package cannot read its load-balancing loss (no "
                "load_balancing_loss_func beside its forward, or no num_experts and num_experts_per_tok)")
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(7, experts, generator=generator, dtype=torch.float64) for _ in range(2))
    try:
        theirs = float(own(logits, experts, top_k, None))
    except Exception as exc:   # another signature (Doge's takes num_keys before top_k)
        return f"its load_balancing_loss_func is not transformers' Switch-Transformer loss ({type(exc).__name__})"
    ours = float(router_aux_loss(logits, experts, top_k, local=True))
    if abs(theirs - ours) > 1e-5 * max(1.0, abs(ours)):   # transformers computes it in float32
        return (f"its load_balancing_loss_func is not transformers' Switch-Transformer loss ({theirs:.6g} against "
                f"{ours:.6g} on the same router logits), which is the one the package computes over the sequence")
    return None
