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
and runs again from it. Documents restart the state. Not in generation (the model keeps its
state in a list of its own, not a cache: refused on every rank).
"""

import sys

import torch

from ..context import token_mixer_call
from ..model import refusal
from .halo import halo_conv, training_layout
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


def _shifted(hidden, context, lens, cu_seqlens):
    """Each token's previous token over the global sequence (zero where a document starts):
    a depthwise convolution of kernel 2 reading only its first tap, through the halo."""
    C = hidden.shape[-1]
    taps = hidden.new_zeros(C, 2)
    taps[:, 0] = 1
    return halo_conv(hidden, taps, None, training_layout(context, lens), cu_seqlens=cu_seqlens)[0]


def _refuse_state(module, state):
    if state is not None:
        raise refusal(None, f"{type(module).__name__} got a recurrent state (generation, or a forward continuing "
                            "one): the model keeps it in a list of its own, which sequence parallelism does not shard",
                      "Train and evaluate with use_cache=False; generate without sequence parallelism (sp_size=1).")


def time_mix_forward(self, hidden, state=None, use_cache=False):
    """RwkvSelfAttention's forward (the module doc); returns (output, None)."""
    context, lens, cu_seqlens = token_mixer_call(self, hidden.shape[1], {})
    _refuse_state(self, state)
    shifted = _shifted(hidden, context, lens, cu_seqlens)
    key = self.key(hidden * self.time_mix_key + shifted * (1 - self.time_mix_key))
    value = self.value(hidden * self.time_mix_value + shifted * (1 - self.time_mix_value))
    receptance = torch.sigmoid(self.receptance(hidden * self.time_mix_receptance
                                               + shifted * (1 - self.time_mix_receptance)))
    wkv = layout_recurrence(WkvRecurrence(self), [key, value], training_layout(context, lens), cu_seqlens)
    return self.output(receptance * wkv), None


def channel_mix_forward(self, hidden, state=None):
    """RwkvFeedForward's forward (the module doc); returns (output, None)."""
    context, lens, cu_seqlens = token_mixer_call(self, hidden.shape[1], {})
    _refuse_state(self, state)
    shifted = _shifted(hidden, context, lens, cu_seqlens)
    key = torch.square(torch.relu(self.key(hidden * self.time_mix_key + shifted * (1 - self.time_mix_key))))
    receptance = torch.sigmoid(self.receptance(hidden * self.time_mix_receptance
                                               + shifted * (1 - self.time_mix_receptance)))
    return receptance * self.value(key), None


time_mix_forward.runs_on_a_ring = channel_mix_forward.runs_on_a_ring = True   # halo and state passing follow the ring
