"""The Gated DeltaNet layers of Qwen3-Next, Qwen3.5 (dense and MoE), Lara and OLMo-Hybrid,
sequence-parallel by heads (docs/hf_hybrids.md, "Hybrid models"; the shared rule: mixers.py).

One layer, as transformers 5.24 and 5.25 compute it on one device: projections give q, k (key
heads), v, z (value heads), b and a (one value per value head); q|k|v go through a
depthwise causal convolution and SiLU; the gated delta rule runs per value head (its key
head shared by `Hv / Hk` value heads, q and k L2-normalised inside), with decay
`g = -exp(A_log) * softplus(a + dt_bias)` and `beta = sigmoid(b)` (OLMo-Hybrid's
`allow_neg_eigval`: twice that); a gated RMSNorm per value head (gate z) and the output
projection. OLMo-Hybrid projects q, k, v, the gate (its z), b and a one by one.

Sequence-parallel: the projections run on the local shard; q, k, v (before the
convolution), b and a go to the head layout in one exchange (key heads split, or
replicated when fewer than the ranks); the convolution (its weights sliced to this rank's
channels inside the forward, so gradients reach the full parameters), the decay and the
rule run over the whole sequence of the local heads, restarting at every document
boundary; the output comes back and the norm and output projection run on the local
shard with the local z. The rule itself is the one the layer's modeling module uses
(transformers' torch implementation on CPU, or the kernel it loaded), called once per
document.
"""

import sys
from typing import Optional

import torch
import torch.nn.functional as F

from ....api import ulysses_head_parallel
from ....layout import place_heads
from ..family import BY_HEADS, Adapter, Family
from ..mixer_ring import mixer_conv, portion_pieces, ring_recurrence
from ..mixers import chunk_head_parallel, over_documents

GATED_DELTANET_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                          "LaraMiniGatedDeltaNet", "OlmoHybridGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet")


def placement_problem(module, world: int) -> Optional[str]:
    """Why this layer's heads have no placement over `world` ranks (None: they have)."""
    if module.num_v_heads % world:
        return (f"its linear-attention value heads ({module.num_v_heads}) are not divisible by the sequence-parallel "
                f"size ({world})")
    try:
        place_heads(module.num_k_heads, world)
    except ValueError:
        return (f"its linear-attention key heads ({module.num_k_heads}) can be neither split over nor replicated to "
                f"{world} ranks")
    return None


def _projections(module, hidden_states):
    """q, k `[B, S, Hk, Dk]`, v, z `[B, S, Hv, Dv]`, b, a `[B, S, Hv]` of the local shard."""
    B, S, _ = hidden_states.shape
    if hasattr(module, "in_proj_qkvz"):   # Qwen3-Next: interleaved per key-head group
        return module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states))
    if hasattr(module, "q_proj"):   # OLMo-Hybrid: one projection each, the gate's named g_proj
        return (module.q_proj(hidden_states).reshape(B, S, -1, module.head_k_dim),
                module.k_proj(hidden_states).reshape(B, S, -1, module.head_k_dim),
                module.v_proj(hidden_states).reshape(B, S, -1, module.head_v_dim),
                module.g_proj(hidden_states).reshape(B, S, -1, module.head_v_dim),
                module.b_proj(hidden_states), module.a_proj(hidden_states))
    q, k, v = torch.split(module.in_proj_qkv(hidden_states), [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (q.reshape(B, S, -1, module.head_k_dim), k.reshape(B, S, -1, module.head_k_dim),
            v.reshape(B, S, -1, module.head_v_dim), module.in_proj_z(hidden_states).reshape(B, S, -1, module.head_v_dim),
            module.in_proj_b(hidden_states), module.in_proj_a(hidden_states))


def _local_conv(module, key_heads: range, value_heads: range):
    """The convolution's weight `[C_local, K]` and bias for this rank's q|k|v channels (the
    layer's channels are q (key heads x Dk), k (same), v (value heads x Dv))."""
    dk, dv, key_dim = module.head_k_dim, module.head_v_dim, module.key_dim
    spans = [(key_heads.start * dk, key_heads.stop * dk), (key_dim + key_heads.start * dk, key_dim + key_heads.stop * dk),
             (2 * key_dim + value_heads.start * dv, 2 * key_dim + value_heads.stop * dv)]
    weight = module.conv1d.weight[:, 0, :]
    local_weight = torch.cat([weight[a:b] for a, b in spans])
    bias = module.conv1d.bias
    local_bias = None if bias is None else torch.cat([bias[a:b] for a, b in spans])
    return local_weight, local_bias


def _delta_rule(module):
    """The chunked gated delta rule the layer's modeling module calls."""
    return sys.modules[type(module).__module__].torch_chunk_gated_delta_rule


class DeltaRuleChunks:
    """The gated delta rule as `mixer_ring.ring_recurrence` takes it: linear in its state
    `[B, Hv, Dk, Dv]` (float32, as transformers computes it), which leaves a chunk as
    `M S + F` with `M = prod_t (I - beta_t k_t k_t^T) exp(g_t)`: the rule itself, run on
    zero values from the identity, gives M. `ring_recurrence` runs a chunk before it asks
    for a transition, an identity or a zero state, so these take the rule's state dtype."""

    def __init__(self, rule):
        self.rule = rule
        self.state_dtype = torch.float32   # the rule's (transformers': float32), learnt from its first run

    def run(self, inputs, initial):
        q, k, v, g, beta = inputs
        out, final = self.rule(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
        self.state_dtype = final.dtype
        return out, final

    def transition(self, inputs):
        q, k, v, g, beta = inputs
        _, M = self.rule(q, k, v.new_zeros(*v.shape[:3], q.shape[3]), g=g, beta=beta,
                         initial_state=self.identity(inputs), output_final_state=True, use_qk_l2norm_in_kernel=True)
        return M

    def identity(self, inputs):
        q, v = inputs[0], inputs[2]
        eye = torch.eye(q.shape[3], dtype=self.state_dtype, device=q.device)
        return eye.expand(v.shape[0], v.shape[2], q.shape[3], q.shape[3]).clone()

    def zero_state(self, inputs):
        q, v = inputs[0], inputs[2]
        return torch.zeros(v.shape[0], v.shape[2], q.shape[3], v.shape[3], dtype=self.state_dtype, device=q.device)

    def carry(self, M, state):
        return M @ state


def _heads_forward(module, cu_seqlens, state=None, portion=None):
    """The per-head part of the layer over the whole sequence of this rank's heads; with
    `state` (generation: a chunk after the previous ones, one document per row), the conv
    history and recurrent state of the local heads are read from it and replaced; with a
    ring `portion` (mixer_ring.py), over this ring rank's two chunks, the convolution and
    the state passed from the chunks before them."""
    rule = _delta_rule(module)

    def run(local, heads):
        key_heads, value_heads = heads.heads("q"), heads.heads("v")
        q, k, v = local["q"], local["k"], local["v"]
        B, S = q.shape[:2]
        weight, bias = _local_conv(module, key_heads, value_heads)
        mixed = torch.cat([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], dim=-1)
        mixed = mixer_conv(mixed, weight, bias, module.activation, cu_seqlens=cu_seqlens, state=state, portion=portion)
        q, k, v = torch.split(mixed, [q.shape[2] * q.shape[3], k.shape[2] * k.shape[3], v.shape[2] * v.shape[3]], dim=-1)
        q, k, v = q.reshape(B, S, -1, module.head_k_dim), k.reshape(B, S, -1, module.head_k_dim), \
            v.reshape(B, S, -1, module.head_v_dim)
        index = slice(value_heads.start, value_heads.stop)
        beta = local["b"][..., 0].sigmoid()
        if getattr(module, "allow_neg_eigval", False):   # OLMo-Hybrid: beta in (0, 2)
            beta = beta * 2.0
        # as the layer computes it: in float32 (A might be -inf in fp16)
        g = -module.A_log[index].float().exp() * F.softplus(local["a"][..., 0].float() + module.dt_bias[index])

        return run_delta_rule(rule, [q, k, v, g, beta], cu_seqlens, state=state, portion=portion)
    return run


def run_delta_rule(rule, inputs, cu_seqlens, *, state=None, portion=None):
    """A delta rule (Gated DeltaNet's, Kimi Delta Attention's: `rule(q, k, v, g=, beta=, ...)`)
    over `inputs` `[q, k, v, g, beta]` of this rank's heads: in generation after the state
    kept on the cache (`state["recurrent"]`, replaced), on a ring's portion (mixer_ring.py),
    else each document from a zero state."""
    q, k, v, g, beta = inputs
    if state is not None:
        out, state["recurrent"] = rule(q, k, v, g=g, beta=beta, initial_state=state.get("recurrent"),
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out
    if portion is not None:
        return ring_recurrence(DeltaRuleChunks(rule), portion_pieces(portion, inputs), portion, cu_seqlens)

    def one_document(q, k, v, g, beta):
        return rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=True)[0]
    return over_documents(one_document, inputs, cu_seqlens)


def generation_forward(module, hidden_states, cache, **_):
    """A forward inside `generate` / `prefill` (hf/inference/cache.py's chunks): the layer continues
    from the states of this rank's heads, kept on the cache."""
    B, T = hidden_states.shape[:2]
    state = cache.mixer_state(module.layer_idx, T)
    q, k, v, z, b, a = _projections(module, hidden_states)
    core = chunk_head_parallel(_heads_forward(module, None, state),
                               {"q": q, "k": k, "v": v, "b": b.unsqueeze(-1), "a": a.unsqueeze(-1)}, cache)
    return _gated_norm_and_output(module, core, z)


def _gated_norm_and_output(module, core, z):
    """The gated RMSNorm per value head (gate z) and the output projection, on this rank's
    tokens (`norm`/`out_proj`; OLMo-Hybrid names them `o_norm`/`o_proj`)."""
    norm = module.o_norm if hasattr(module, "o_norm") else module.norm
    out = module.o_proj if hasattr(module, "o_proj") else module.out_proj
    B, T = z.shape[:2]
    core = norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return out(core.reshape(B, T, -1))


def gated_deltanet_forward(self, call, hidden_states: torch.Tensor, **_):
    """The layer's forward over the sequence, by heads (the module doc; the protocol around
    it: family.py)."""
    q, k, v, z, b, a = _projections(self, hidden_states)
    core = ulysses_head_parallel(_heads_forward(self, call.cu_seqlens, portion=call.portion),
                                 {"q": q, "k": k, "v": v, "b": b.unsqueeze(-1), "a": a.unsqueeze(-1)}, call.group,
                                 seq_lens=call.ulysses_lens)
    return _gated_norm_and_output(self, core, z)


# mixer_ring.py passes its state across the ring's chunks
FAMILY = Family("gated_deltanet", (Adapter(GATED_DELTANET_CLASSES, "gated_deltanet", gated_deltanet_forward, BY_HEADS,
                                           problem=placement_problem, runs_on_a_ring=True,
                                           generation=generation_forward, pads=True,
                                           cache_kept="its conv and recurrent states are sharded by heads there only"),),
                model_types=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "lara_mini", "olmo_hybrid", "qwen4_exp_text", "qwen4_exp"),
                planner_shape="gated_deltanet")
