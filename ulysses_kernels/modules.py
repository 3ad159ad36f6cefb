"""The public `nn.Module`s: `UlyssesAttention` (the `ulysses_attention` call for a fixed
group and options) and `UlyssesSelfAttention` (a self-attention block: QKV projection,
Ulysses attention, output projection, whose fused path overlaps the projections with the
exchanges)."""

import math
from typing import Optional

import torch
from torch import nn

from . import fused
from .api import prepare_attention, run_attention, ulysses_attention
from .rotary import apply_rotary, position_embeddings_error
from .variants import make_variant


class UlyssesAttention(nn.Module):
    """`nn.Module` around `ulysses_attention` for a fixed group and options.

    forward(q, k, v, *, seq_lens=None, cu_seqlens=None, sinks=None) with q `[B, S_local, Hq, D]`;
    `window_size` and `softcap` are the call's variants (docs/api.md, "Attention variants"),
    `sinks` a `[Hq]` tensor passed per call (the model owns it as a parameter); `engine`: a
    `fused.Engine` the caller holds (see `ulysses_attention`).
    """

    def __init__(self, group=None, *, causal: bool = False, softmax_scale: Optional[float] = None,
                 backend: Optional[str] = None, ring_group=None, window_size=(-1, -1), softcap: float = 0.0,
                 engine=None):
        super().__init__()
        make_variant(window_size, softcap, causal=causal)  # bad values fail here, not at the first call
        self.group = group
        self.ring_group = ring_group
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.backend = backend
        self.window_size, self.softcap = tuple(window_size), softcap
        self.engine = engine

    def forward(self, q, k, v, *, seq_lens=None, cu_seqlens=None, sinks=None):
        return ulysses_attention(q, k, v, group=self.group, causal=self.causal,
                                 softmax_scale=self.softmax_scale, seq_lens=seq_lens,
                                 cu_seqlens=cu_seqlens, backend=self.backend, ring_group=self.ring_group,
                                 window_size=self.window_size, softcap=self.softcap, sinks=sinks, engine=self.engine)

    def extra_repr(self):
        return (f"causal={self.causal}, softmax_scale={self.softmax_scale}, backend={self.backend}, "
                f"{make_variant(self.window_size, self.softcap, causal=self.causal).describe()}")


class UlyssesSelfAttention(nn.Module):
    """Self-attention over a sequence sharded across the SP group.

    forward(x, *, position_embeddings=None, seq_lens=None, cu_seqlens=None):
    x `[B, S_local, hidden]` -> `[B, S_local, hidden]`. `position_embeddings`: optional
    rotary `(cos, sin)`, each `[B or 1, S_local, head_dim]` for this rank's tokens (global
    positions), applied to q and k in the Hugging Face (Llama) convention
    (`ulysses_kernels.rotary`) in the activation dtype; they are constants (no gradient).

    `qkv_proj` is one `nn.Linear(hidden, (Hq + 2*Hkv) * head_dim)` whose output rows are
    the q heads, then the k heads, then the v heads; `o_proj` is `nn.Linear(Hq * head_dim,
    hidden)`. The attention is `ulysses_attention` with the same options and checks. On the
    fused path (CUDA, extension built, `backend` None or "fused"), with
    `overlap_projections=True` and the weights in the activation dtype (no autocast), the
    projection GEMMs run chunk by chunk inside the exchange pipeline
    (`ulysses_kernels.fused.layer`); otherwise the block is the plain composition.
    `ring_group`: the Ulysses x Ring hybrid (`group` is then the Ulysses group; see
    `ulysses_attention`), which runs the plain composition. `window_size` and `softcap`:
    the attention variants (docs/api.md, "Attention variants"); `sinks=True` gives the
    block a learnable `[num_heads]` parameter `sinks` of sink logits (GPT-OSS), which
    takes the plain composition on every path. `engine`: a `fused.Engine` the caller holds
    (see `ulysses_attention`).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, *, group=None, causal: bool = True,
                 softmax_scale: Optional[float] = None, bias: bool = False, backend: Optional[str] = None,
                 overlap_projections: bool = True, device=None, dtype=None, ring_group=None,
                 window_size=(-1, -1), softcap: float = 0.0, sinks: bool = False, engine=None):
        super().__init__()
        make_variant(window_size, softcap, causal=causal)  # bad values fail here, not at the first call
        self.window_size, self.softcap = tuple(window_size), softcap
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"UlyssesSelfAttention: need num_heads ({num_heads}) a positive multiple of "
                             f"num_kv_heads ({num_kv_heads}) and head_dim ({head_dim}) > 0")
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = (
            hidden_size, num_heads, num_kv_heads, head_dim)
        self.group, self.causal, self.softmax_scale, self.backend = group, causal, softmax_scale, backend
        self.ring_group = ring_group
        self.overlap_projections = overlap_projections
        self.engine = engine
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, **kw)
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype)) if sinks else None

    def _placeholders(self, x, position_embeddings):
        """Stand-ins for q/k/v with the shapes, dtype and device the projection would give,
        for the validation (nothing is read from them), plus local errors for bad inputs."""
        ok = isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[-1] == self.hidden_size
        error = [] if ok else [f"x must be [batch, seq_local, {self.hidden_size}], got "
                               f"{tuple(getattr(x, 'shape', ()))}"]
        B, S = (x.shape[0], x.shape[1]) if ok else (1, 1)
        if ok:
            rotary_error = position_embeddings_error(position_embeddings, B, S, self.head_dim, x.device)
            error += [rotary_error] if rotary_error else []
        device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        dtype = x.dtype if isinstance(x, torch.Tensor) else torch.float32
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        base = torch.empty((), dtype=dtype, device=device)
        D = self.head_dim
        return (base.expand(B, S, self.num_heads, D), base.expand(B, S, self.num_kv_heads, D),
                base.expand(B, S, self.num_kv_heads, D), error)

    def _overlap_ok(self, x) -> bool:
        params = [self.qkv_proj.weight, self.o_proj.weight]
        params += [b for b in (self.qkv_proj.bias, self.o_proj.bias) if b is not None]
        return (self.overlap_projections and not torch.is_autocast_enabled(x.device.type)
                and all(p.dtype == x.dtype and p.device == x.device for p in params))

    def forward(self, x, *, position_embeddings=None, seq_lens=None, cu_seqlens=None):
        q, k, v, errors = self._placeholders(x, position_embeddings)
        call = prepare_attention(q, k, v, group=self.group, ring_group=self.ring_group, causal=self.causal,
                                 softmax_scale=self.softmax_scale, seq_lens=seq_lens, cu_seqlens=cu_seqlens,
                                 backend=self.backend, local_errors=errors, window_size=self.window_size,
                                 softcap=self.softcap, sinks=self.sinks, engine=self.engine)
        B, S, _ = x.shape
        # The layer has no ring and no sinks (a parameter its autograd function would have to return).
        if call.path is fused.PATH and call.ring is None and self.sinks is None and self._overlap_ok(x):
            return fused.self_attention(
                x, self.qkv_proj.weight, self.qkv_proj.bias, self.o_proj.weight, self.o_proj.bias,
                num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                group=call.group, rank=call.rank, seq_lens=call.lens, causal=call.causal,
                softmax_scale=call.softmax_scale, cu_seqlens=call.cu_seqlens,
                position_embeddings=position_embeddings, variant=call.variant, engine=call.engine)
        qkv = self.qkv_proj(x).view(B, S, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        hq, hkv = self.num_heads, self.num_kv_heads
        q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
        if position_embeddings is not None:
            cos, sin = (t.detach().to(q.dtype) for t in position_embeddings)  # as on the fused path
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = run_attention(call, q, k, v, sinks=self.sinks)
        return self.o_proj(out.reshape(B, S, hq * self.head_dim))

    def extra_repr(self):
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        return (f"hidden={self.hidden_size}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, softmax_scale={scale:.4g}, "
                f"backend={self.backend}, overlap_projections={self.overlap_projections}")
