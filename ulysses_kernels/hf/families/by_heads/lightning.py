"""MiniMax's lightning attention (MiniMax-Text-01), sequence-parallel by heads (docs/hf_hybrids.md,
"Hybrid models"; the shared rule: mixers.py).

One layer, as transformers 5.24 and 5.25 compute it: `qkv = act(qkv_proj(h))` split per head
into q, k, v; per head h a linear attention with a fixed decay `l_h = exp(-slope_h)` (the
slope set by the head and the layer's depth, a buffer):

    S_t = l_h S_{t-1} + k_t^T v_t,    o_t = q_t S_t          (no normaliser, no feature map)

then an RMSNorm over all heads of a token, the gate `sigmoid(output_gate(h))` and `out_proj`.
transformers evaluates the recurrence in blocks of `block_size`; the blocks are a
computation detail (its result is the recurrence's); the chunks here are the layer's blocks.

Sequence-parallel: q, k, v go to the head layout in one exchange; the recurrence runs over
the whole sequence of this rank's heads, restarting at every document start; the output
comes back and the norm, gate and projection run on the local shard. Under a ring the state
passes from chunk to chunk (mixer_ring.py): a chunk of n tokens leaves `l^n S + F`. In
generation each rank keeps its heads' states `[B, H_local, D, D]` on the head-sharded cache.
"""

import sys
from typing import Optional

import torch

from ....api import ulysses_head_parallel
from ..family import BY_HEADS, Adapter, Family
from ..mixer_ring import portion_pieces, ring_recurrence
from ..mixers import chunk_head_parallel, over_documents

LIGHTNING_CLASSES = ("MiniMaxLightningAttention",)


def placement_problem(module, world: int) -> Optional[str]:
    """Why this layer's heads have no placement over `world` ranks (None: they have)."""
    if module.num_attention_heads % world:
        return (f"its lightning-attention heads ({module.num_attention_heads}) are not divisible by the "
                f"sequence-parallel size ({world})")
    return None


def decayed_linear_attention(q, k, v, log_decay, initial=None, chunk: int = 64):
    """o_t = q_t S_t with S_t = exp(log_decay) S_{t-1} + k_t^T v_t, per head: q, k `[B, S, H, Dk]`,
    v `[B, S, H, Dv]`, log_decay `[H]` (negative), initial `[B, H, Dk, Dv]` or None. Returns (o
    `[B, S, H, Dv]`, the final state). In chunks of `chunk`: within one the decayed scores
    `(q k^T) * l^(i-j)` (i >= j), across them the state."""
    B, S, H, _ = q.shape
    state = initial if initial is not None else q.new_zeros(B, H, q.shape[3], v.shape[3])
    decay = log_decay.to(q.dtype)[None, :, None, None]
    out = []
    for start in range(0, S, chunk):
        qc, kc, vc = (t[:, start:start + chunk].transpose(1, 2) for t in (q, k, v))   # [B, H, n, D]
        n = qc.shape[2]
        steps = torch.arange(n, device=q.device, dtype=q.dtype)
        distance = steps[:, None] - steps[None, :]
        inside = torch.where(distance >= 0, torch.exp(decay * distance.clamp(min=0)), torch.zeros((), dtype=q.dtype))
        intra = ((qc @ kc.transpose(-1, -2)) * inside) @ vc
        inter = (qc * torch.exp(decay * (steps[:, None] + 1))) @ state
        out.append((intra + inter).transpose(1, 2))
        state = torch.exp(decay * n) * state + (kc * torch.exp(decay * (n - 1 - steps)[:, None])).transpose(-1, -2) @ vc
    return torch.cat(out, dim=1), state


class LightningChunks:
    """The recurrence as `mixer_ring.ring_recurrence` takes it: a chunk of n tokens leaves
    `l^n S + F` (a scalar decay per head)."""

    def __init__(self, log_decay, chunk: int):
        self.log_decay, self.chunk = log_decay, chunk

    def run(self, inputs, initial):
        q, k, v = inputs
        return decayed_linear_attention(q, k, v, self.log_decay, initial, self.chunk)

    def transition(self, inputs):
        q = inputs[0]
        return torch.exp(self.log_decay.to(q.dtype) * q.shape[1]).expand(q.shape[0], -1).contiguous()   # [B, H]

    def identity(self, inputs):
        q = inputs[0]
        return q.new_ones(q.shape[0], q.shape[2])

    def zero_state(self, inputs):
        q, v = inputs[0], inputs[2]
        return q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])

    def carry(self, M, state):
        return M[..., None, None] * state


def _log_decay(module, heads: range):
    """-slope of this rank's heads (the layer's buffer, so its dtype is the model's)."""
    return -module.slope_rate[heads.start:heads.stop, 0, 0]


def _qkv(module, hidden_states, attention_mask):
    """q, k, v `[B, S, H, D]` of the local tokens, as the layer computes them."""
    B, S, _ = hidden_states.shape
    qkv = module.act_fn(module.qkv_proj(hidden_states))
    qkv = sys.modules[type(module).__module__].apply_mask_to_padding_states(qkv, attention_mask)
    qkv = qkv.reshape(B, S, module.num_attention_heads, 3 * module.head_dim)
    return torch.split(qkv, module.head_dim, dim=3)


def _heads_forward(module, cu_seqlens, state=None, portion=None):
    def run(local, heads):
        log_decay, chunk = _log_decay(module, heads.heads("q")), module.block_size
        q, k, v = local["q"], local["k"], local["v"]
        if state is not None:
            out, state["recurrent"] = decayed_linear_attention(q, k, v, log_decay, state.get("recurrent"), chunk)
            return out
        if portion is not None:
            return ring_recurrence(LightningChunks(log_decay, chunk), portion_pieces(portion, [q, k, v]), portion,
                                   cu_seqlens)
        return over_documents(lambda q, k, v: decayed_linear_attention(q, k, v, log_decay, None, chunk)[0],
                              [q, k, v], cu_seqlens)
    return run


def _output(module, core, hidden_states):
    """The norm over the token's heads, the gate and the projection, on the local tokens."""
    B, S = hidden_states.shape[:2]
    core = module.norm(core.reshape(B, S, -1))
    return module.out_proj(torch.sigmoid(module.output_gate(hidden_states)) * core)


def generation_forward(module, hidden_states, cache, **_):
    """A forward inside `generate` / `prefill`: the layer continues from the states of this
    rank's heads, kept on the cache; returns (output, None)."""
    state = cache.mixer_state(module.layer_idx, hidden_states.shape[1])
    q, k, v = _qkv(module, hidden_states, None)
    core = chunk_head_parallel(_heads_forward(module, None, state), {"q": q, "k": k, "v": v}, cache)
    return _output(module, core, hidden_states), None


def lightning_forward(self, call, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **_):
    """The layer's forward over the sequence, by heads (the module doc; the protocol around
    it: family.py); returns (output, None) as the decoder layer unpacks it."""
    q, k, v = _qkv(self, hidden_states, attention_mask)
    core = ulysses_head_parallel(_heads_forward(self, call.cu_seqlens, portion=call.portion), {"q": q, "k": k, "v": v},
                                 call.group, seq_lens=call.ulysses_lens)
    return _output(self, core, hidden_states), None


# mixer_ring.py passes its state across the ring's chunks; MiniMax's forward insists on its own cache
FAMILY = Family("lightning", (Adapter(LIGHTNING_CLASSES, "lightning", lightning_forward, BY_HEADS,
                                      problem=placement_problem, runs_on_a_ring=True, own_cache="MiniMaxCache",
                                      generation=generation_forward,
                                      cache_kept="its states are sharded by heads there only"),),
                model_types=("minimax",),
                planner_shape="lightning")
