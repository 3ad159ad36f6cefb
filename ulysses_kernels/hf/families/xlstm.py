"""xLSTM's mLSTM layers, sequence-parallel by heads (docs/hf_hybrids.md, "Hybrid models"; the
shared rule: mixers.py).

One layer, as transformers 5.24 and 5.25 compute it (`xLSTMLayer`): per token q, k, v, the
output gate's and the input and forget gates' pre-activations (soft-capped); per head the
matrix memory in log space with a stabiliser m,

    C_t = f_t C_{t-1} + i_t k_t v_t^T,   n_t = f_t n_{t-1} + i_t k_t,   h_t = q_t C_t / max(|q_t n_t|, exp(-m_t))

(the layer's backend: its chunkwise kernel in training, its chunked sequence kernel in
inference mode); then a LayerNorm per head, the output gate and `out_proj`.

Sequence-parallel: q, k, v and the two gate pre-activations go to the head layout in one
exchange; the layer's own backend runs over the whole sequence of this rank's heads, once
per document; the output comes back and the norm, the gate and `out_proj` run on the local
shard. Not on a ring (the stabilised state does not compose as `M S + F`: refused on every
rank), and not in generation (the model keeps its state in a cache of its own, `xLSTMCache`,
which the package's decoding cache does not provide: refused on every rank).
"""

from typing import Optional

import torch

from ...api import ulysses_head_parallel
from ..context import token_mixer_call
from ..model import refusal
from .mixers import over_documents

XLSTM_CLASSES = ("xLSTMLayer",)


def placement_problem(module, world: int) -> Optional[str]:
    """Why this layer's heads have no placement over `world` ranks (None: they have)."""
    if module.config.num_heads % world:
        return f"its mLSTM heads ({module.config.num_heads}) are not divisible by the sequence-parallel size ({world})"
    return None


def _inputs(module, x):
    """q, k `[B, S, NH, Dqk]`, v and the output gate's pre-activation `[B, S, NH, Dv]` (the
    latter flat), the input and forget gates' pre-activations `[B, S, NH, 1]`, as the layer."""
    config, soft_cap = module.config, _soft_cap(module)
    B, S, _ = x.shape
    if config.weight_mode == "single":
        q, k, v, o = module.q(x), module.k(x), module.v(x), module.ogate_preact(x)
        i = soft_cap(module.igate_preact(x), cap_value=config.gate_soft_cap)
        f = soft_cap(module.fgate_preact(x), cap_value=config.gate_soft_cap)
    else:
        q, k, v, o = torch.tensor_split(module.qkv_opreact(x), (module.qk_dim, 2 * module.qk_dim,
                                                                2 * module.qk_dim + module.v_dim), dim=-1)
        i, f = torch.tensor_split(soft_cap(module.ifgate_preact(x), cap_value=config.gate_soft_cap),
                                  (config.num_heads,), dim=-1)
    heads = config.num_heads
    q, k, v = (t.reshape(B, S, heads, -1) for t in (q, k, v))
    return q, k, v, o, i.unsqueeze(-1), f.unsqueeze(-1)


def _soft_cap(module):
    import sys

    return sys.modules[type(module).__module__].soft_cap


def _heads_forward(module, cu_seqlens):
    def one_document(q, k, v, i, f):
        out = module.mlstm_backend(query=q.transpose(1, 2), key=k.transpose(1, 2), value=v.transpose(1, 2),
                                   igate=i[..., 0].transpose(1, 2), fgate=f[..., 0].transpose(1, 2))
        h = out[0] if isinstance(out, tuple) else out
        return h.transpose(1, 2)

    def run(local, heads):
        return over_documents(one_document, [local["q"], local["k"], local["v"], local["i"], local["f"]], cu_seqlens)
    return run


def xlstm_forward(self, x: torch.Tensor, state=None):
    """The mLSTM layer's forward, sequence-parallel by heads (the module doc); returns (y,
    None) as the block unpacks it."""
    context, lens, cu_seqlens = token_mixer_call(self, x.shape[1], {})
    group, world, _ = context.ulysses()
    name = type(self).__name__
    if state is not None:
        raise refusal(None, f"{name} got a recurrent state (a cache, or the model's chunked inference in eval mode): "
                            "its states are not kept sharded by heads",
                      "Train and evaluate with use_cache=False in train mode, or with max_inference_chunksize above "
                      "the sequence length.")
    problem = placement_problem(self, world)
    if problem:
        raise refusal(None, f"{name}: {problem}")
    B, S, _ = x.shape
    q, k, v, o, i, f = _inputs(self, x)
    h = ulysses_head_parallel(_heads_forward(self, cu_seqlens), {"q": q, "k": k, "v": v, "i": i, "f": f}, group,
                              seq_lens=lens)
    h = self.multihead_norm(h).reshape(B, S, -1)
    return self.out_proj(self.ogate_act_fn(o) * h), None
