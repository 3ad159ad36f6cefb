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
rank).

Generation (`ulysses_kernels.hf.generate` / `prefill`): each rank keeps the states `(C, n, m)`
of its own heads on the decoding cache (`mixer_states`), as the other mixers sharded by heads.
transformers' xLSTMModel reads its cache's `rnn_state[layer]` and hands it to the layer: the
decoding cache answers with a `DecodingSlot` (which layer, which cache; `XlstmCacheFields`),
so the adapted layer finds its states there. A sharded prefill chunk runs the layer's backend
over the whole chunk for this rank's heads from their states; a decode step runs this rank's
heads and all-gathers their outputs (`mixers.chunk_head_parallel`).
"""

from typing import Optional

import torch

from ....api import ulysses_head_parallel
from ...model import refusal
from ..family import BY_HEADS, Adapter, Family, LayerSlot
from ..mixers import chunk_head_parallel, over_documents

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


_STATES = ("C", "n", "m")   # the mLSTM's states, in transformers' order


class DecodingSlot(LayerSlot):
    """Layer `layer`'s entry of the decoding cache's `rnn_state` (what transformers' xLSTMModel
    passes to the layer as its state; the protocol, family.py, takes it for the decoding cache):
    the adapted layer reads and replaces its heads' states in `cache.mixer_states`. Indexed like
    transformers' `(C, n, m)`, so a model that copies the layer's returned states into it copies
    them onto themselves."""

    def __len__(self):
        return 3

    def __getitem__(self, index):
        return self.cache.mixer_states[self.layer][_STATES[index]]


class _Slots:
    def __init__(self, cache):
        self.cache = cache

    def __getitem__(self, layer):
        return DecodingSlot(self.cache, layer)


class XlstmCacheFields:
    """What transformers' xLSTMModel reads of its cache besides the layers' states (the
    decoding cache derives from this: this module's FAMILY, own_cache): `rnn_state[layer]`, a
    `DecodingSlot`, and `seqlen_offset`, which the model counts up."""
    seqlen_offset = 0

    @property
    def rnn_state(self):
        return _Slots(self)


def _decoding_heads(module, state):
    """The layer's backend on this rank's heads of a generation chunk, from their states
    (`state["C"]`, `["n"]`, `["m"]`; none before the first chunk), which it replaces."""
    def run(local, heads):
        c, n, m = (state.get(name) for name in _STATES)
        h, last = module.mlstm_backend(query=local["q"].transpose(1, 2), key=local["k"].transpose(1, 2),
                                       value=local["v"].transpose(1, 2), igate=local["i"][..., 0].transpose(1, 2),
                                       fgate=local["f"][..., 0].transpose(1, 2), c_initial=c, n_initial=n,
                                       m_initial=m, return_last_states=True)
        state.update(zip(_STATES, (t.detach() for t in last)))
        return h.transpose(1, 2)
    return run


def generation_forward(module, x, slot, **_):
    """A forward inside `generate` / `prefill` (the protocol, family.py, has counted it and
    refused a placement): this rank's heads continue from their states; returns (y, the slot),
    as the block unpacks it."""
    _refuse_pieces(module, slot.cache)
    state = slot.cache.mixer_state(slot.layer, x.shape[1])
    B, S, _ = x.shape
    q, k, v, o, i, f = _inputs(module, x)
    h = chunk_head_parallel(_decoding_heads(module, state), {"q": q, "k": k, "v": v, "i": i, "f": f}, slot.cache)
    h = module.multihead_norm(h).reshape(B, S, -1)
    return module.out_proj(module.ogate_act_fn(o) * h), slot


def _refuse_pieces(module, cache):
    """In eval mode the model cuts a rank's tokens into pieces of max_inference_chunksize,
    which are not contiguous over the ranks: a prefill chunk longer on a rank is refused,
    alike on every rank (from every rank's length)."""
    limit = module.config.max_inference_chunksize
    if cache.chunk_lens is not None and not module.training and max(cache.chunk_lens) > limit:
        raise refusal(None, f"{type(module).__name__} got a prefill chunk of {max(cache.chunk_lens)} tokens on a "
                            f"rank: in eval mode the model cuts a rank's tokens into pieces of max_inference_chunksize "
                            f"({limit}), which are not contiguous over the ranks",
                      "Prefill in chunks of at most the sequence-parallel size x max_inference_chunksize "
                      "(ulysses_kernels.hf.generate's prefill_chunk_size, prefill's chunk_size).")


def xlstm_forward(self, call, x: torch.Tensor, **_):
    """The mLSTM layer's forward over the sequence, by heads (the module doc; the protocol
    around it: family.py); returns (y, None) as the block unpacks it."""
    B, S, _ = x.shape
    q, k, v, o, i, f = _inputs(self, x)
    h = ulysses_head_parallel(_heads_forward(self, call.cu_seqlens), {"q": q, "k": k, "v": v, "i": i, "f": f},
                              call.group, seq_lens=call.lens)
    h = self.multihead_norm(h).reshape(B, S, -1)
    return self.out_proj(self.ogate_act_fn(o) * h), None


# A recurrent state outside generation is refused whatever the size: the model's own (a cache,
# or its chunked inference in eval mode) is not kept sharded by heads.
_STATE_REFUSED = ("a recurrent state (a cache, or the model's chunked inference in eval mode): its states are not "
                  "kept sharded by heads",
                  "Train and evaluate with use_cache=False in train mode, or with max_inference_chunksize above the "
                  "sequence length.")

# its model hands the layer its states as `state` (in generation, the layer's DecodingSlot) and
# reads the fields of XlstmCacheFields of its cache
FAMILY = Family("xlstm", (Adapter(XLSTM_CLASSES, "mlstm", xlstm_forward, BY_HEADS, problem=placement_problem,
                                  own_cache=XlstmCacheFields, generation=generation_forward,
                                  cache_refused=_STATE_REFUSED),),
                model_types=("xlstm",),
                planner_shape="mlstm")
