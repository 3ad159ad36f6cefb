"""RWKV (RWKV-4) under sequence parallelism, without a per-token exchange: the token shift by
the sequence halo, the WKV recurrence by state passing (docs/hf_hybrids.md, "State passing";
halo.py, state_passing.py).

One block, as transformers 5.24 and 5.25 compute it: the time mixing (`RwkvSelfAttention`) mixes
each token with the previous one (`time_shift`, zero before the sequence) into key, value and
receptance; the WKV recurrence per channel with a decay `w = -exp(time_decay)` and a bonus
`u = time_first` for the current token,

    wkv_t = (num_{t-1} + e^{u + k_t} v_t) / (den_{t-1} + e^{u + k_t}),
    num_t = e^w num_{t-1} + e^{k_t} v_t,    den_t = e^w den_{t-1} + e^{k_t}

kept in log space with a running maximum (transformers' CPU kernel, float32); the output
`output(sigmoid(r) * wkv)`. The channel mixing (`RwkvFeedForward`) shifts the same way, then
is per token.

Sequence-parallel: the shifts read the last input of the shard before (a halo of one token,
zero where a document starts); the WKV state is diagonal (a decay per channel), so each rank
runs its shard with the layer's own kernel from zero, the ranks share each shard's (decay,
final state), and every rank composes the state entering its shard in log space (`compose`)
and runs again from it. Documents restart the state.

Generation (`ulysses_kernels.hf.generate` / `prefill`): the layer's state (the last input of
each shift, the WKV state `(num, den, max)`) is small and the same on every rank, kept in the
decoding cache (`mixer_state`, per block); a sharded prefill chunk continues from it by the
halo and state passing, a replicated one (decoding) runs the layer on the whole chunk. The
model's own state list, when it passes one, gets the same values, so what it returns is
what one device returns.
"""

import sys

import torch

from ..family import HALO, STATE_PASSING, Adapter, Family
from .halo import generation_layout, halo_conv, training_layout
from .state_passing import layout_recurrence

TIME_MIX_CLASSES = ("RwkvSelfAttention",)
CHANNEL_MIX_CLASSES = ("RwkvFeedForward",)
_NO_CARRY = -1e38   # the kernel's own "minus infinity" for a log-space maximum


class WkvRecurrence:
    """The WKV recurrence as `mixer_ring.ring_recurrence` takes it: inputs (k, v `[B, n, C]`),
    the state `[B, 3, C]` (num, den, max: the true state is `e^max (num, den)`); a range of n
    tokens leaves `e^{w n} S` plus its own final state, composed in log space."""

    def __init__(self, module):
        self.kernel = sys.modules[type(module).__module__].rwkv_linear_attention_cpu
        self.time_decay, self.time_first = module.time_decay, module.time_first

    def run(self, inputs, initial):
        k, v = inputs
        if k.shape[1] == 0:   # a rank without tokens (the kernel indexes the first token)
            return v.clone(), initial if initial is not None else self.zero_state(inputs)
        state = tuple(initial.unbind(dim=1)) if initial is not None else None
        out, final = self.kernel(self.time_decay, self.time_first, k, v, state=state, return_state=True)
        return out, torch.stack(final, dim=1).to(self._dtype(inputs))

    @staticmethod
    def _dtype(inputs):
        """The kernel's state dtype: float32 promoted with the values' (every rank's the same,
        also a rank without tokens, whose states its peers gather)."""
        return torch.promote_types(torch.float32, inputs[1].dtype)

    def transition(self, inputs):
        k = inputs[0]
        decay = -torch.exp(self.time_decay.to(self._dtype(inputs))) * k.shape[1]
        return decay.expand(k.shape[0], -1)

    def identity(self, inputs):
        k = inputs[0]
        return k.new_zeros(k.shape[0], k.shape[2], dtype=self._dtype(inputs))

    def no_carry(self, inputs):
        return torch.full_like(self.identity(inputs), _NO_CARRY)

    def zero_state(self, inputs):
        zero = self.identity(inputs)
        return torch.stack([zero, zero, zero + _NO_CARRY], dim=1)

    def compose(self, log_decay, state, final):
        carried, own = state[:, 2] + log_decay, final[:, 2]
        top = torch.maximum(carried, own)
        a, b = torch.exp(carried - top), torch.exp(own - top)
        return torch.stack([a * state[:, 0] + b * final[:, 0], a * state[:, 1] + b * final[:, 1], top], dim=1)


def _shifted(hidden, layout, cu_seqlens=None, before=None):
    """Each token's previous token over the global sequence (zero where a document starts,
    `before` before position 0): a depthwise convolution of kernel 2 reading only its first
    tap, through the halo. Returns (shifted, the last input `[B, 1, C]`)."""
    taps = hidden.new_zeros(hidden.shape[-1], 2)
    taps[:, 0] = 1
    return halo_conv(hidden, taps, None, layout, cu_seqlens=cu_seqlens, before=before)


def _mixed(module, hidden, shifted, name):
    mix = getattr(module, f"time_mix_{name}")
    return getattr(module, name)(hidden * mix + shifted * (1 - mix))


def _time_mix(module, hidden, shifted, layout, cu_seqlens, initial=None):
    """(output, WKV state leaving the sequence) of the time mixing, its shift given."""
    key, value = _mixed(module, hidden, shifted, "key"), _mixed(module, hidden, shifted, "value")
    receptance = torch.sigmoid(_mixed(module, hidden, shifted, "receptance"))
    wkv, final = layout_recurrence(WkvRecurrence(module), [key, value], layout, cu_seqlens, initial=initial,
                                   with_final=True)
    return module.output(receptance * wkv), final


def _channel_mix(module, hidden, shifted):
    key = torch.square(torch.relu(_mixed(module, hidden, shifted, "key")))
    return torch.sigmoid(_mixed(module, hidden, shifted, "receptance")) * module.value(key)


def _block_state(module, cache, length, *, first):
    """The block's state in the cache (a dict, every rank's the same). The time mixing, the
    block's first mixer, opens it for the forward in progress; the channel mixing after it
    reads the same dict."""
    if first:
        return cache.mixer_state(module.layer_id, length)
    return cache.mixer_states.setdefault(module.layer_id, {})


def _keep(model_state, index, layer_id, value):
    """The model's own state list (`[B, C, layers]` tensors), when it passes one, gets the
    cache's value for this block."""
    if model_state is not None:
        model_state[index][:, :, layer_id] = value


def time_mix_generation(module, hidden, cache, state=None, **_):
    """RwkvSelfAttention inside `generate` / `prefill` (the protocol takes the context's
    decoding cache: family.py); returns (output, the model's state list)."""
    kept = _block_state(module, cache, hidden.shape[1], first=True)
    layout = generation_layout(cache, hidden.shape[1])
    shifted, kept["time_shift"] = _shifted(hidden, layout, before=kept.get("time_shift"))
    out, kept["wkv"] = _time_mix(module, hidden, shifted, layout, None, initial=kept.get("wkv"))
    kept["time_shift"], kept["wkv"] = kept["time_shift"].detach().clone(), kept["wkv"].detach()
    _keep(state, 1, module.layer_id, kept["time_shift"][:, -1])
    for index, part in zip((2, 3, 4), kept["wkv"].unbind(dim=1)):
        _keep(state, index, module.layer_id, part)
    return out, state


def channel_mix_generation(module, hidden, cache, state=None, **_):
    """RwkvFeedForward inside `generate` / `prefill`; returns (output, the model's state list)."""
    kept = _block_state(module, cache, hidden.shape[1], first=False)
    layout = generation_layout(cache, hidden.shape[1])
    shifted, last = _shifted(hidden, layout, before=kept.get("channel_shift"))
    kept["channel_shift"] = last.detach().clone()
    _keep(state, 0, module.layer_id, kept["channel_shift"][:, -1])
    return _channel_mix(module, hidden, shifted), state


def time_mix_forward(self, call, hidden, **_):
    """RwkvSelfAttention's forward over the sequence (the module doc; the protocol around it:
    family.py); returns (output, None) for the model's state list."""
    layout = training_layout(call.context, call.lens)
    return _time_mix(self, hidden, _shifted(hidden, layout, call.cu_seqlens)[0], layout, call.cu_seqlens)[0], None


def channel_mix_forward(self, call, hidden, **_):
    """RwkvFeedForward's forward over the sequence (the module doc); returns (output, None)."""
    layout = training_layout(call.context, call.lens)
    return _channel_mix(self, hidden, _shifted(hidden, layout, call.cu_seqlens)[0]), None


# Outside generation the model's own state list would be filled per rank: refused whatever the
# size, the same on every rank
STATE_REFUSED = ("a recurrent state outside ulysses_kernels.hf.generate / prefill: the model's own state list is not "
                 "shared over the sequence-parallel ranks",
                 "Train and evaluate with use_cache=False; generate with ulysses_kernels.hf.generate.")
# the halo and the state passing follow the ring's chunks; the model hands the blocks its state
# list, not the decoding cache, so the protocol takes the context's
_OWN_STATES = dict(runs_on_a_ring=True, decoding_from_context=True, cache_refused=STATE_REFUSED)
FAMILY = Family("rwkv", (Adapter(TIME_MIX_CLASSES, "rwkv", time_mix_forward, STATE_PASSING,
                                 generation=time_mix_generation, **_OWN_STATES),
                         Adapter(CHANNEL_MIX_CLASSES, "rwkv", channel_mix_forward, HALO,
                                 generation=channel_mix_generation, **_OWN_STATES)),
                model_types=("rwkv",),
                planner_shape="rwkv")
