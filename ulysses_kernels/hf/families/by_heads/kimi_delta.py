"""Kimi Delta Attention (KDA) of Kimi Linear and Ling's hybrids (`bailing_hybrid`),
sequence-parallel by heads (docs/hf_hybrids.md, "Hybrid models"; the shared rule: mixers.py).

One layer, as transformers 5.24 and 5.25 compute it: q, k, v projected one by one (heads x
head dim each), a depthwise causal convolution of q|k|v with SiLU; per token a forget gate
per key channel (Kimi: a low-rank projection plus `dt_bias`, `-exp(A_log) softplus(.)`;
Ling: one projection, the same or the "safe" `lower_bound * sigmoid(.)`) and `beta =
sigmoid(b_proj(h))` per head; the delta rule per head with a per-channel decay (q and k
L2-normalised inside):

    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

then a gated RMSNorm per head (the gate a per-token projection) and `o_proj`.

Sequence-parallel as the Gated DeltaNet (gated_deltanet.py): the projections and the gates
run on the local shard (they are per token); q, k, v (before the convolution), the forget
gate and b go to the head layout in one exchange; the convolution (its weights sliced to this
rank's channels) and the rule run over the whole sequence of the local heads, per document;
the output comes back for the norm and `o_proj`. The rule is the one the layer's modeling
module calls (transformers' torch `chunk_kimi_delta_attention` on CPU, or the kernel it
loaded). Under a ring the state passes from chunk to chunk as the Gated DeltaNet's does: the
rule run on zero values from the identity gives a chunk's transition (`DeltaRuleChunks`).
"""

import sys
from typing import Optional

import torch

from ....api import ulysses_head_parallel
from ..family import BY_HEADS, Adapter, Family
from ..mixer_ring import mixer_conv
from ..mixers import chunk_head_parallel
from .gated_deltanet import run_delta_rule

KDA_CLASSES = ("KimiLinearDeltaAttention", "BailingHybridDeltaAttention")


def placement_problem(module, world: int) -> Optional[str]:
    """Why this layer's heads have no placement over `world` ranks (None: they have)."""
    if module.num_heads % world:
        return (f"its delta-attention heads ({module.num_heads}) are not divisible by the sequence-parallel size "
                f"({world})")
    return None


def _inputs(module, hidden_states):
    """q, k, v, the forget gate `[B, S, H, D]` and b `[B, S, H, 1]` of the local tokens."""
    B, S, _ = hidden_states.shape
    shape = (B, S, module.num_heads, module.head_dim)
    q, k, v = (proj(hidden_states).reshape(shape) for proj in (module.q_proj, module.k_proj, module.v_proj))
    return q, k, v, module.forget_gate(hidden_states), module.b_proj(hidden_states).unsqueeze(-1)


def _output_gate(module, hidden_states):
    """The per-token gate of the output norm (Kimi: low rank; Ling: one projection)."""
    if hasattr(module, "g_a_proj"):
        return module.g_b_proj(module.g_a_proj(hidden_states))
    return module.g_proj(hidden_states)


def _local_conv(module, heads: range):
    """The convolution's weight `[C_local, K]` and bias for this rank's q|k|v channels."""
    d, width = module.head_dim, module.qkv_dim
    spans = [(part * width + heads.start * d, part * width + heads.stop * d) for part in range(3)]
    weight = module.conv1d.weight[:, 0, :]
    bias = module.conv1d.bias
    return torch.cat([weight[a:b] for a, b in spans]), (None if bias is None else torch.cat([bias[a:b] for a, b in spans]))


def _rule(module):
    return sys.modules[type(module).__module__].chunk_kimi_delta_attention


def _heads_forward(module, cu_seqlens, state=None, portion=None):
    rule = _rule(module)

    def run(local, heads):
        q, k, v = local["q"], local["k"], local["v"]
        B, S, H, D = q.shape
        weight, bias = _local_conv(module, heads.heads("q"))
        mixed = torch.cat([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], dim=-1)
        mixed = mixer_conv(mixed, weight, bias, module.activation, cu_seqlens=cu_seqlens, state=state, portion=portion)
        q, k, v = (t.reshape(B, S, H, D) for t in mixed.split(H * D, dim=-1))
        g, beta = local["g"], local["b"][..., 0].sigmoid()
        return run_delta_rule(rule, [q, k, v, g, beta], cu_seqlens, state=state, portion=portion)
    return run


def _output(module, core, hidden_states):
    B, S = hidden_states.shape[:2]
    gate = _output_gate(module, hidden_states).reshape(B, S, module.num_heads, module.head_dim)
    return module.o_proj(module.o_norm(core, gate).reshape(B, S, -1))


def generation_forward(module, hidden_states, cache, **_):
    """A forward inside `generate` / `prefill`: the layer continues from the states of this
    rank's heads, kept on the cache."""
    state = cache.mixer_state(module.layer_idx, hidden_states.shape[1])
    q, k, v, g, b = _inputs(module, hidden_states)
    core = chunk_head_parallel(_heads_forward(module, None, state), {"q": q, "k": k, "v": v, "g": g, "b": b}, cache)
    return _output(module, core, hidden_states)


def kimi_delta_forward(self, call, hidden_states: torch.Tensor, **_):
    """The layer's forward over the sequence, by heads (the module doc; the protocol around
    it: family.py)."""
    q, k, v, g, b = _inputs(self, hidden_states)
    core = ulysses_head_parallel(_heads_forward(self, call.cu_seqlens, portion=call.portion),
                                 {"q": q, "k": k, "v": v, "g": g, "b": b}, call.group, seq_lens=call.ulysses_lens)
    return _output(self, core, hidden_states)


# mixer_ring.py passes its state across the ring's chunks
FAMILY = Family("kimi_delta", (Adapter(KDA_CLASSES, "kimi_delta", kimi_delta_forward, BY_HEADS,
                                       problem=placement_problem, runs_on_a_ring=True, generation=generation_forward,
                                       pads=True, cache_kept="its conv and recurrent states are sharded by heads "
                                                             "there only"),),
                model_types=("kimi_linear", "bailing_hybrid"),
                planner_shape="kimi_delta")
