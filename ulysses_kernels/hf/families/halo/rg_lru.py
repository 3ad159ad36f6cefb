"""RecurrentGemma's recurrent blocks (Griffin's RG-LRU), sequence-parallel without a per-token
exchange: the sequence halo for the convolution, state passing for the recurrence
(docs/hf_hybrids.md, "State passing"; halo.py, state_passing.py).

One block, as transformers 5.24 and 5.25 compute it: `y = act(linear_y(h))`; `x = linear_x(h)`
through a depthwise causal convolution (`conv1d_width`, with bias, no activation); per token
an input gate and a recurrence gate from x (block-diagonal weights, one block per head), the
decay `a = exp(-8 r softplus(recurrent_param))`; the input `x * i * sqrt(1 - a^2)` (not scaled
where a document starts: `position_ids == 0`, where the gate `a` is zeroed too); the recurrence
per channel

    h_t = a_t h_{t-1} + u_t

(in float32 at least, as transformers accumulates); then `linear_out(h * y)`.

Everything but the convolution and the recurrence is per token and runs on the local shard;
the convolution reads the `conv1d_width - 1` inputs before each shard; the recurrence's
transition is diagonal (`prod_t a_t` per channel), so each rank passes its state. The resets
come from the global positions `shard_batch` gives, so they fall where the documents start.
In generation the block's conv history and recurrent state, the same on every rank, live on
the package's decoding cache (transformers keeps them on the module): a sharded prefill chunk
composes them, a decode step continues from them.
"""

import sys

import torch
import torch.nn.functional as F

from ...model import refusal
from ..family import STATE_PASSING, Adapter, Family
from ..mixers import causal_conv1d, conv_history
from .halo import contiguous_layout, halo_conv, training_layout
from .state_passing import layout_recurrence

RG_LRU_CLASSES = ("RecurrentGemmaRecurrentBlock",)


class GatedRecurrence:
    """h_t = a_t h_{t-1} + u_t as `mixer_ring.ring_recurrence` takes it: inputs (a, u
    `[B, n, C]`), the state `[B, C]`; a range leaves `prod_t a_t S + F`."""

    def run(self, inputs, initial):
        a, u = inputs
        state = initial if initial is not None else u.new_zeros(u.shape[0], u.shape[2])
        out = []
        for t in range(u.shape[1]):
            state = a[:, t] * state + u[:, t]
            out.append(state)
        return (torch.stack(out, dim=1) if out else u.new_zeros(u.shape)), state

    def transition(self, inputs):
        return inputs[0].prod(dim=1)

    def identity(self, inputs):
        u = inputs[1]
        return u.new_ones(u.shape[0], u.shape[2])

    def zero_state(self, inputs):
        u = inputs[1]
        return u.new_zeros(u.shape[0], u.shape[2])

    def carry(self, M, state):
        return M * state


def _gates(lru, x, position_ids):
    """(a, u) of the recurrence, in the accumulation dtype (float32 at least), from the
    convolved x `[B, S, C]` and this shard's global positions (RecurrentGemmaRglru's rule)."""
    B, S, C = x.shape
    heads = x.reshape(B * S, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)
    gate = lambda weight, bias: torch.sigmoid(torch.baddbmm(bias[:, None, :], heads, weight)   # noqa: E731
                                              .transpose(0, 1).reshape(B, S, C))
    input_gate = gate(lru.input_gate_weight, lru.input_gate_bias)
    log_a = -8.0 * gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias) * F.softplus(lru.recurrent_param)
    reset = position_ids[:, :, None] == 0
    sqrt = sys.modules[type(lru).__module__].SqrtBoundDerivative   # sqrt with its gradient clipped, as the layer
    multiplier = sqrt.apply(1 - torch.exp(2 * log_a))
    multiplier = reset + ~reset * multiplier
    u = x * input_gate * multiplier.type(x.dtype)
    acc = torch.promote_types(x.dtype, torch.float32)
    return (torch.exp(log_a) * ~reset).to(acc), u.to(acc)


def _recurrence_in_generation(module, x, position_ids, cache):
    """h of a chunk of `generate` / `prefill`: the block's conv history and recurrent state, the
    same on every rank, on the decoding cache (keyed by the block: it has no layer index);
    a sharded chunk (the prefill) by the halo and state passing, a replicated one (decoding)
    as on one device."""
    state = cache.mixer_state(module, x.shape[1])
    weight, bias = module.conv_1d.weight[:, 0, :], module.conv_1d.bias
    before = state.get("conv")
    if cache.chunk_lens is not None:
        layout = contiguous_layout(cache.ulysses, cache.chunk_lens)
        x, state["conv"] = halo_conv(x, weight, bias, layout, before=before)
        a, u = _gates(module.rg_lru, x, position_ids)
        h, state["recurrent"] = layout_recurrence(GatedRecurrence(), [a, u], layout, None,
                                                  initial=state.get("recurrent"), with_final=True)
    else:
        state["conv"] = conv_history(before, x, weight.shape[-1])
        x = causal_conv1d(x, weight, bias, None, None, history=before)
        a, u = _gates(module.rg_lru, x, position_ids)
        h, state["recurrent"] = GatedRecurrence().run([a, u], state.get("recurrent"))
    state["conv"], state["recurrent"] = state["conv"].detach(), state["recurrent"].detach()
    return h


def generation_forward(module, input_states, decoding, position_ids, **_):
    """A forward inside `generate` / `prefill` over the context's decoding cache (the block's
    own `cache` argument among the others: family.py); returns (output, None) as the layer
    unpacks it."""
    y = module.act_fn(module.linear_y(input_states))
    x = module.linear_x(input_states)
    h = _recurrence_in_generation(module, x, position_ids, decoding)
    return module.linear_out(h.to(x.dtype) * y), None


def refuse_module_states(module, context, cache, use_cache=True, **_):
    """Outside generation transformers keeps the block's states on the module, per rank, so a
    cache is refused on several ranks; on one, or with use_cache=False, the package's forward
    runs (it drops the module's states, as transformers' does without a cache)."""
    if use_cache and cache is not None and context.sp_size > 1:
        raise refusal(None, f"{type(module).__name__} got a cache outside ulysses_kernels.hf.generate / prefill: "
                            "its state is kept on the module, per rank",
                      "Generate with ulysses_kernels.hf.generate, and train with use_cache=False.")


def recurrent_block_forward(self, call, input_states: torch.Tensor, position_ids: torch.Tensor, **_):
    """The block's forward over the sequence (the module doc; the protocol around it:
    family.py); returns (output, None) as the layer unpacks it. The states transformers keeps
    on the module are dropped, as its own forward drops them without a cache."""
    self.conv1d_state = self.rg_lru.recurrent_states = None
    y = self.act_fn(self.linear_y(input_states))
    layout = training_layout(call.context, call.lens)
    x, _ = halo_conv(self.linear_x(input_states), self.conv_1d.weight[:, 0, :], self.conv_1d.bias, layout,
                     cu_seqlens=call.cu_seqlens)
    a, u = _gates(self.rg_lru, x, position_ids)
    h = layout_recurrence(GatedRecurrence(), [a, u], layout, call.cu_seqlens)
    return self.linear_out(h.to(x.dtype) * y), None


# the halo and the state passing follow the ring's chunks; the block's states are not in a
# transformers cache (on the module), so the protocol takes the context's decoding cache
FAMILY = Family("rg_lru", (Adapter(RG_LRU_CLASSES, "rg_lru", recurrent_block_forward, STATE_PASSING,
                                   runs_on_a_ring=True, generation=generation_forward,
                                   decoding_from_context=True, cache_rule=refuse_module_states),),
                model_types=("recurrent_gemma",),
                planner_shape="rg_lru")
