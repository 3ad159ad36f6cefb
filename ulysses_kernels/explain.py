"""``ulysses-kernels doctor --explain``: what runs for one Ulysses attention call class.

For a global call (batch, sequence, heads, head dim, dtype, mask and variants, world
size) it states, from the rules the package runs (never a copy of them):

* the heads and tokens of one rank (layout.HeadPlan);
* the path the automatic choice takes on this machine, and why each faster path cannot
  run here (api.PATHS' own ``problem``);
* the kernel choice for one rank's attention (kernel_choice/): every candidate considered
  or excluded with the reason, and the choice with its timings;
* the fused path's exchange: transport and chunks (fused/engine.py, fused/plan.py);
* the Triton kernels of one rank's attention on a GPU target (ulysses_kernels.triton.plan:
  the launchers' own decisions on meta tensors): kernel, tile and why, layout, Hopper
  features on and dropped with reasons, the backward's mode and head splits.

Imports of torch and the paths are lazy: the CLI loads this module for doctor only.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class CallClass:
    """One global attention call: q ``[batch, seq_len, heads, head_dim]`` sharded over
    ``world`` ranks by sequence; ``documents``: equal packed documents (batch 1), 0 for
    none; ``window``: flash_attn's (left, right), -1 unbounded."""

    batch: int = 1
    seq_len: int = 131072
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    head_dim_v: Optional[int] = None
    dtype: str = "bf16"
    causal: bool = True
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    documents: int = 0
    world: int = 8
    deterministic: bool = False

    def text(self) -> str:
        extras = [name for name, on in (("causal", self.causal), ("sinks", self.sinks),
                                        ("deterministic", self.deterministic)) if on]
        if self.window != (-1, -1):
            extras.append(f"window {self.window}")
        if self.softcap:
            extras.append(f"softcap {self.softcap:g}")
        if self.documents:
            extras.append(f"{self.documents} packed documents")
        dv = f"/{self.head_dim_v}" if self.head_dim_v not in (None, self.head_dim) else ""
        return (f"q [{self.batch}, {self.seq_len}, {self.heads}, {self.head_dim}{dv}] {self.dtype}, "
                f"{self.kv_heads} KV heads, world {self.world}" + (", " + ", ".join(extras) if extras else ""))


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _rank_lines(call: CallClass):
    from .layout import HeadPlan, split_lengths

    heads = HeadPlan(call.world, call.heads, call.kv_heads)
    lens = split_lengths(call.seq_len, call.world)
    kv = "split" if call.kv_heads % call.world == 0 else "replicated"
    return heads, [("per rank", f"{lens[0]} tokens in (lengths {min(lens)}..{max(lens)}); attention over "
                                f"{call.seq_len} tokens x {heads.local_q_heads} query heads, "
                                f"{heads.local_kv_heads} KV heads ({kv})")]


def _path_lines(call: CallClass, device):
    import torch

    from .api import PATHS, resolve_path

    dtype = _torch_dtype(call.dtype)
    sample = tuple(torch.zeros(1, 4, h, call.head_dim, dtype=dtype, device=device)
                   for h in (call.heads, call.kv_heads, call.kv_heads))
    try:
        chosen = resolve_path(None, device, distributed=call.world > 1, tensors=sample)
    except Exception as exc:  # noqa: BLE001 - report it
        return [("path here", f"none: {exc}")]
    lines = [("path here", f"{chosen} (automatic choice on {device}; ULYSSES_KERNELS_BACKEND or backend= forces one)")]
    for name in ("fused", "triton"):
        if name != chosen:
            why = PATHS[name].problem(device, sample)
            lines.append((f"  not {name}", why or "available, but the automatic choice prefers another"))
    return lines


def choice_class(call: CallClass, heads, device):
    """The kernel choice's class of one rank's attention in `call` (the Triton and fused
    paths build the same one from their buffers)."""
    from . import kernel_choice
    from .variants import make_variant

    variant = make_variant(call.window, call.softcap, causal=call.causal)
    return kernel_choice.call_for(device, _torch_dtype(call.dtype), batch=call.batch, q_len=call.seq_len,
                                  k_len=call.seq_len, q_heads=heads.local_q_heads, kv_heads=heads.local_kv_heads,
                                  head_dim=call.head_dim, value_dim=call.head_dim_v or call.head_dim,
                                  causal=call.causal, variant=variant, sinks=call.sinks, packed=call.documents > 0,
                                  rows_layout=call.batch > 1 and call.world > 1, deterministic=call.deterministic,
                                  grad=True)


def _choice_lines(call: CallClass, heads, device):
    from .kernel_choice import explain as choice_explain

    return choice_explain.explain(choice_class(call, heads, device))


def _exchange_lines(call: CallClass, heads):
    import torch

    from .fused.engine import choose_transport
    from .fused.pipeline import Geometry
    from .fused.plan import resolve_num_chunks
    from .layout import split_lengths

    geo = Geometry(batch=call.batch, lens=tuple(split_lengths(call.seq_len, call.world)), rank=0,
                   head_dim=call.head_dim)
    recv_bytes = geo.recv_numel(heads.channels) * torch.empty((), dtype=_torch_dtype(call.dtype)).element_size()
    try:
        chunks = resolve_num_chunks(None, call.world, heads.local_q_heads, heads.local_kv_heads, recv_bytes)
        chunk_text = f"{chunks} (a {recv_bytes / 2**20:.1f} MiB q/k/v receive buffer per rank; " \
                     "ULYSSES_KERNELS_NUM_CHUNKS overrides)"
    except ValueError as exc:
        chunk_text = f"INVALID: {exc}"
    try:
        factory, why = choose_transport(torch.device("cuda"))
        transport = f"{factory.__name__ if factory else 'none'} ({why})"
    except Exception as exc:  # noqa: BLE001 - a bad ULYSSES_KERNELS_TRANSPORT, or no CUDA here
        transport = f"unknown here: {exc}"
    return [("fused transport", transport), ("fused chunks", chunk_text)]


def _kernel_lines(call: CallClass, heads, sm_count: int):
    from .extensions import triton_kernels

    module, why = triton_kernels()
    if module is None:
        return [("Triton kernels", f"not importable here: {why}")]
    from .triton.plan import Target, describe, plan_attention
    from .variants import make_variant

    variant = make_variant(call.window, call.softcap, causal=call.causal)  # as the paths convert it
    documents = None
    if call.documents:
        step = call.seq_len // call.documents
        documents = tuple(min(i * step, call.seq_len) for i in range(call.documents)) + (call.seq_len,)
    plan = plan_attention(batch=call.batch, seqlen_q=call.seq_len, seqlen_k=call.seq_len,
                          num_q_heads=heads.local_q_heads, num_kv_heads=heads.local_kv_heads,
                          head_dim=call.head_dim, head_dim_v=call.head_dim_v, dtype=_torch_dtype(call.dtype),
                          causal=call.causal, band=variant.window, softcap=variant.softcap, sinks=call.sinks,
                          documents=documents, seq_splits=call.world, deterministic=call.deterministic,
                          target=Target("cuda", interpreting=False, sm_count=sm_count))
    return [("Triton kernels", f"one rank's attention on a GPU with {sm_count} SMs (sm_90 configs; the fused path "
                               "launches the same kernels per chunk of heads)")] + describe(plan)


def explain(call: CallClass, *, device=None, sm_count: int = 132) -> List[Tuple[str, str]]:
    """(name, text) lines of what runs for `call` (module docstring)."""
    import torch

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, lines = _rank_lines(call)
    lines = [("call", call.text())] + lines
    lines += _path_lines(call, device)
    lines += _choice_lines(call, heads, device)
    lines += _exchange_lines(call, heads)
    lines += _kernel_lines(call, heads, sm_count)
    return lines
