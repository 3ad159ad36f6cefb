"""Shared pieces of the Triton flash-attention kernels.

Addressing. Every tensor is passed with a base pointer and its (batch, seq, head, dim)
strides. The constexpr ``SPLIT`` selects how a token's sequence offset is formed
(docs/architecture.md, "Attention kernels: addressing"):

* ``SPLIT=0`` (strided): element (b, s, h, d) at
  ``base + b*stride_b + s*stride_s + h*stride_h + d*stride_d``. Also used for the
  all-to-all buffer when it degenerates to this (batch 1, or a single block).
* ``SPLIT=2`` (all-to-all buffer, per token): the buffer holds P blocks, block i a
  contiguous ``[B, S_i, H, D]`` array with ``S_i`` the ``torch.tensor_split`` lengths of
  S over P, blocks adjacent in memory. Token (b, s) with s in block i lives at row
  ``B*seq_start[i] + b*S_i + (s - seq_start[i])`` and the element at
  ``base + row*stride_s + h*stride_h + d*stride_d`` (``stride_b`` unused).
* ``SPLIT=1`` (all-to-all buffer, affine tiles): the same layout when every block holds
  ``L = S/P`` tokens and L is a multiple of every tile height (the host checks
  ``L % affine_align() == 0``). A tile then never straddles two blocks, so its rows are
  ``row(s0) + i``: one scalar base per tile, computed once, instead of two int32
  divisions per token per iteration.

For SPLIT 0 and 1 a tile's offsets are ``tile_base(s0) + i*stride_s``: the second term
does not depend on the loop variable, so the compiler keeps it out of the inner loops
and only the scalar base advances. All offsets are int64 (sequences of millions of
tokens times large row strides).

Variants (compile-time switches, off by default: without them a kernel builds the same
instructions as before, bench/sass_report.py; docs/architecture.md, "Attention variants"):

* ``WINDOW``: a band. With off = Sk - Sq, query i sees key j iff
  ``i + off - left <= j <= i + off + right`` (runtime ints ``window_left`` /
  ``window_right``, negative allowed; the host folds ``causal`` into the right side and
  clamps both, see :func:`kernel_band`). The loops visit only the blocks inside the band.
* ``SOFTCAP``: scores ``c * tanh(scale * q.k / c)`` (tanh from exp2: :func:`capped_tanh`).
* ``SINKS`` (forward only): one logit per query head in the softmax denominator.
* ``HEAD_DIM_V`` / ``BLOCK_DV``: v, out, dO and dV have a head dim of their own.
* ``COUNT``: tests count the blocks each program visits (one atomic add per loop
  iteration into ``COUNTS``; :class:`VisitCounter`).
"""

import contextlib
import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..env import TRITON_AUTOTUNE, flag, interpreting  # noqa: F401  (interpreting: re-exported to the kernel modules)
from ..variants import fold_causal

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
TWO_LOG2E = 2.0 * LOG2E


# Read once at import: decides whether kernels are wrapped in @triton.autotune.
INTERPRET_AT_IMPORT = interpreting()


def autotune_enabled() -> bool:
    """Autotuning runs only on a GPU (never in the interpreter) unless disabled by env."""
    if INTERPRET_AT_IMPORT:
        return False
    return flag(TRITON_AUTOTUNE, default=True)


class Target(NamedTuple):
    """Where a launch runs, as its decisions see it: the device type ("cuda" or "cpu"),
    whether Triton interprets the kernels, and the GPU's SM count (0: unknown). A launch
    reads it from its tensors (``Target.of``); a plan (``ulysses_kernels.triton.plan``)
    may describe another machine's (meta tensors, a GPU's target)."""

    device_type: str
    interpreting: bool
    sm_count: int = 0

    @classmethod
    def of(cls, tensor) -> "Target":
        device = tensor.device
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        return cls(device.type, interpreting(), sms)

    @property
    def gpu(self) -> bool:
        """Compiled kernels on a GPU (not the interpreter)."""
        return self.device_type == "cuda" and not self.interpreting


class KernelCall(NamedTuple):
    """One attention call as every launcher reads it, built once per call by ``ops._run_fwd``
    / ``_run_bwd``: the shapes as the kernels see them (one rank's heads, the SPLIT mode),
    the mask after ``kernel_band`` (causal, band, the documents' id per key and boundary
    table), the variant and where it runs."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    split: int                            # the SPLIT mode (split_mode)
    seq_splits: int
    causal: bool                          # kernel_band's
    band: Optional[Tuple[int, int]]       # kernel_band's (None: WINDOW off)
    softcap: float                        # c, or 0 for none
    softmax_scale: float
    docs: Optional[torch.Tensor]          # document id per key position (VARLEN), or None
    cu_seqlens: Optional[torch.Tensor]    # the boundary table the kernels index, or None
    target: Target

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def varlen(self) -> bool:
        return self.docs is not None

    def documents(self, dummy):
        """The (ids, table) pair a kernel takes: ``dummy`` for both without documents."""
        return (self.docs, self.cu_seqlens) if self.varlen else (dummy, dummy)


class RowStats(NamedTuple):
    """The per-row statistics the backward kernels read: the forward's LSE and delta =
    rowsum(dO * O), fp32 ``[B, Hq, Sq]``, rows ``row_stride`` apart (None: Sq, contiguous;
    the warp-specialized kernels take padded rows, ``flash_bwd.tma_row_stats``)."""

    lse: torch.Tensor
    delta: torch.Tensor
    row_stride: Optional[int] = None


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_d(head_dim: int) -> int:
    return max(16, next_pow2(head_dim))


def seq_bucket(n: int) -> int:
    """Autotune key: log2 bucket of a sequence length (retune per power of two only)."""
    return max(0, int(math.ceil(math.log2(max(1, n)))))


def dot_precision(dtype: torch.dtype, head_dim: int = 128) -> str:
    """tl.dot input precision. 16-bit inputs ignore it ("tf32").

    fp32 inputs: exact "ieee" products in the interpreter (tests). On the GPU "ieee" means
    no tensor cores: the sm_90 build of a 64x32 tile already needs kilobytes of local
    memory per thread and a minute to compile. "tf32x3" (three tf32 wgmmas, about fp32
    accuracy) is used instead, and plain "tf32" for head dims above 128, where the tf32x3
    tiles no longer fit in shared memory.
    """
    if dtype != torch.float32:
        return "tf32"
    if interpreting():
        return "ieee"
    return "tf32x3" if head_dim <= 128 else "tf32"


def affine_align() -> int:
    """Block lengths that are multiples of this allow SPLIT=1: the largest tile height of
    any config (128 on the GPU; the interpreter's tiles are at most 32)."""
    return 32 if interpreting() else 128


# Largest sequence stride (elements) of any tensor: a tile's offsets from its base,
# up to 256 rows, must fit int32 (see seq_offsets).
MAX_ROW_STRIDE = (2**31 - 1) // 256


def split_mode(is_buffer: bool, batch: int, seq_splits: int, seq_lens) -> int:
    """The SPLIT constexpr of a call (see the module docstring).

    is_buffer: 3-D all-to-all buffer views. seq_lens: the sequence lengths of the
    tensors involved (queries, keys), each split over seq_splits blocks.
    """
    if not is_buffer or batch == 1 or seq_splits == 1:
        return 0  # batch 1: row = s; one block: row = b*S + s (stride_b = S*stride_s)
    align = affine_align() * seq_splits
    return 1 if all(n % align == 0 for n in seq_lens) else 2


@triton.jit
def token_rows(s, b, S, B, P):
    """Row of each token ``s`` (int32 positions) of batch ``b`` in the P-block all-to-all
    buffer (SPLIT=2; see module docstring), as int64, to be scaled by the row stride.
    The block arithmetic runs in int32 (positions and lengths are < 2**31; an int64
    division per token is a slow multi-instruction sequence on the GPU); only the row,
    which can exceed 2**31 for B*S rows, is int64.
    """
    s32 = s.to(tl.int32)
    q = S // P
    rem = S - q * P
    big = rem * (q + 1)
    # Block index of each token: the first `rem` blocks hold q+1 tokens, the rest q.
    blk = tl.where(s32 < big, s32 // (q + 1), rem + (s32 - big) // tl.maximum(q, 1))
    start = blk * q + tl.minimum(blk, rem)
    length = q + (blk < rem).to(tl.int32)
    return start.to(tl.int64) * B + b.to(tl.int64) * length + (s32 - start).to(tl.int64)


@triton.jit
def tile_base(s0, b, S, B, P, stride_b, stride_s, SPLIT: tl.constexpr):
    """int64 element offset of token ``s0`` of batch ``b`` (SPLIT 0 or 1): the tile
    starting at s0 has its token s0 + i at ``tile_base + i*stride_s``."""
    # (s0 is a plain int in the interpreter's loops: widen by adding an int64 zero.)
    start = tl.zeros([], tl.int64) + s0
    if SPLIT == 1:
        length = S // P
        blk = s0 // length
        row = start + length.to(tl.int64) * (blk * (B - 1) + b)
        return row * stride_s
    else:
        return b.to(tl.int64) * stride_b + start * stride_s


@triton.jit
def seq_offsets(s, s0, local, b, S, B, P, stride_b, stride_s, SPLIT: tl.constexpr):
    """Element offsets of the tokens ``s = s0 + local`` of batch ``b`` as ``(scalar, rows)``.

    Callers add ``scalar`` to the base pointer and ``rows`` (a 1-D int64 tensor) to the
    per-element offsets: for SPLIT 0/1 ``rows = local*stride_s`` does not depend on s0,
    so it is hoisted out of the loops (int32: tiles span < 2**31 elements, see
    ``MAX_ROW_STRIDE``); for SPLIT 2 every token's row is computed (int64).
    """
    if SPLIT == 2:
        return tl.zeros([], tl.int64), token_rows(s, b, S, B, P) * stride_s
    else:
        # int32 (the host checks |stride_s| * 256 < 2**31): the hoisted offsets take one
        # register each instead of two (int64 here spilled the forward's 128x128 tile).
        return tile_base(s0, b, S, B, P, stride_b, stride_s, SPLIT), local * stride_s


@triton.jit
def tile_row(s0, b, S, B, P, SPLIT: tl.constexpr):
    """Row of token ``s0`` of batch ``b`` in a tensor descriptor's 2-D view (KV_DESC,
    SPLIT 0 or 1), int32 as TMA coordinates are: the view is batch b's S rows (SPLIT 0), or
    the buffer's B*S rows, block i holding batch b's tokens at ``B*i*L + b*L`` (SPLIT 1,
    L = S/P; tiles never straddle two blocks)."""
    if SPLIT == 1:
        length = S // P
        blk = s0 // length
        return s0 + length * (blk * (B - 1) + b.to(tl.int32))
    else:
        return s0


@triton.jit
def kv_descriptor(base, rows, row_stride, cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """A device-side tensor descriptor (TMA on Hopper) of ``rows x cols`` elements at
    ``base`` with unit column stride, loaded in ``[BLOCK_ROWS, BLOCK_COLS]`` tiles. Tiles
    past its bounds read zeros: keys past the sequence and dims past the head dim need no
    mask. The host checks TMA's rules first (features.descriptor_ok)."""
    return tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[row_stride, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def maybe_fp32(x, FP32_DOT: tl.constexpr):
    """The interpreter's tl.dot is wrong on bf16: compute in fp32 there (only there)."""
    if FP32_DOT:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def capped_tanh(qk, softcap_in):
    """``t = tanh(scale * qk / softcap)`` of raw dot products (SOFTCAP), the score being
    ``softcap * t``; ``softcap_in = 2 * log2(e) * scale / softcap``. Built from exp2 (no
    libdevice tanh on every Triton): ``tanh(x) = 1 - 2 / (e^(2x) + 1)``, exactly +-1
    where exp2 overflows or underflows. Each score pays one more exp2 and a reciprocal
    (two MUFU ops; the forward's main loop: status.md rows `fwd plain` and `fwd softcap`,
    D = 128, bench/sass_report.py)."""
    return 1.0 - 2.0 / (tl.math.exp2(qk * softcap_in) + 1.0)


# Autotune key shared by all attention kernels: retune per head dims, mask kind, variant,
# layout, GQA group and power-of-two sequence bucket. (Head counts, lengths, the GQA group
# and the window sides are runtime arguments, never specialized on: one compiled kernel
# serves every head count.) Each kernel is keyed on the names it declares.
TUNE_KEYS = ["TUNE_KEY", "HEAD_DIM", "BLOCK_D", "HEAD_DIM_V", "BLOCK_DV", "CAUSAL", "VARLEN", "SPLIT", "GROUP",
             "WINDOW", "SOFTCAP", "SINKS", "COUNT", "KV_DESC", "FMA_SCALE", "LAZY_RESCALE", "WARP_SPECIALIZE",
             "DQ_REDUCE"]


def kernel_band(causal, window, seqlen_q, seqlen_k):
    """(causal, band) as the kernels take a mask: band None (WINDOW off) or (left, right)
    ints for the band rule (see blocks.in_band), causal folded into it (``variants.fold_causal``).

    A side that hides no key becomes unbounded (None): left >= Sk - 1, right >= Sq - 1.
    No band left, or only the causal edge (left unbounded, right 0): the causal or the
    plain kernels, unchanged. Otherwise sides are clamped to where they hide every key
    (left >= -Sq, right >= -Sk), so the kernels' int32 arithmetic cannot overflow.
    """
    left, right = fold_causal(window, causal)
    if causal:  # the causal edge as the band's right side (kept only if a window remains)
        right = 0 if right is None else int(right)
    if left is not None and left >= seqlen_k - 1:
        left = None
    if right is not None and right >= seqlen_q - 1:
        right = None
    if left is None and right is None:
        return False, None
    if left is None and right == 0:
        return True, None
    left = seqlen_k if left is None else max(int(left), -seqlen_q)
    right = seqlen_q if right is None else max(int(right), -seqlen_k)
    return False, (left, right)


class KernelVariant(NamedTuple):
    """A launch's variant arguments: ``softcap`` = (softcap_in, softcap_out) and ``window``
    = (left, right) runtime tuples, ``constexprs`` = {WINDOW, SOFTCAP}."""

    softcap: Tuple[float, float]
    window: Tuple[int, int]
    constexprs: Dict[str, bool]


def variant_args(band, softcap: float, softmax_scale: float) -> KernelVariant:
    """The variant arguments of a launch. band: kernel_band's (None: no window); softcap:
    c > 0, or 0 for none. ``softcap_in = 2 log2(e) scale / c`` feeds capped_tanh,
    ``softcap_out = c log2(e)`` turns tanh into a log2-unit score."""
    left, right = band if band is not None else (0, 0)
    cap_in = TWO_LOG2E * softmax_scale / softcap if softcap else 0.0
    return KernelVariant(softcap=(cap_in, softcap * LOG2E), window=(int(left), int(right)),
                         constexprs=dict(WINDOW=band is not None, SOFTCAP=bool(softcap)))


class VisitCounter:
    """Tests (COUNT): how many blocks each program of a kernel visits (see
    ``ops._count_visited_blocks``). ``slots`` must cover the largest grid of the call."""

    def __init__(self, device, slots: int):
        self.device, self.slots = device, int(slots)
        self.counts, self.configs, self.grids = {}, {}, {}

    def tensor(self, name: str) -> torch.Tensor:
        """A zeroed int32 counter for kernel ``name``: program p adds to slot p."""
        self.counts[name] = torch.zeros(self.slots, dtype=torch.int32, device=self.device)
        return self.counts[name]

    def ran(self, name: str, config, grid) -> None:
        """Kernel ``name`` ran ``config`` on ``grid``: program (x, y) counted in slot
        ``y * grid[0] + x``."""
        self.configs[name] = config
        self.grids[name] = grid


def _zero_before_each_trial(names):
    """An autotuner pre-hook that zero-fills the named arguments (a tuple parameter: each of
    its tensors) before each trial and before the chosen run: accumulators must restart
    from zero. (Triton's own reset_to_zero takes plain tensor arguments only.)"""
    def hook(kwargs, reset_only=False):
        for name in names:
            value = kwargs[name]
            for tensor in value if isinstance(value, tuple) else (value,):
                tensor.zero_()
    return hook


class LaunchPlan(NamedTuple):
    """One kernel launch as a plan describes it (TunedLauncher with ``plan``): the kernel,
    its grid (at the config, or the default when autotuned), its config (BLOCK_M, BLOCK_N,
    num_warps, num_stages; None when autotuned), the default config and why, its features'
    Switches records and its constexprs."""

    kernel: str
    grid: Tuple[int, ...]
    config: Optional[Tuple[int, int, int, int]]
    default: Tuple[int, int, int, int]
    config_why: str
    switches: Tuple[object, ...]
    constexprs: Dict[str, object]


class PlanNote(NamedTuple):
    """A decision of a planned call that is not a launch's (the backward's mode, its head
    splits): what was decided, the choice and why."""

    topic: str
    choice: str
    why: str


def plan_autotunes(fp32_dot: bool) -> bool:
    """Whether a planned GPU launch would autotune (ULYSSES_KERNELS_TRITON_AUTOTUNE, on by
    default; never in the interpreter)."""
    return not fp32_dot and flag(TRITON_AUTOTUNE, default=True)


class TunedLauncher:
    """Launch policy of one kernel over its ``configs.ConfigSet`` (the one table,
    ``configs.CONFIGS``): on a GPU with autotuning enabled the kernel is autotuned over the
    candidates of its head dim (pruned per launch by the rule of :meth:`choose`); otherwise
    the default runs; in the interpreter the small ``interpret_blocks`` keep tests fast.
    :meth:`forced` runs one config on the GPU inside a ``with`` block (benchmark sweeps).
    """

    def __init__(self, kernel, config_set, reset_to_zero=None):
        self.kernel = kernel
        self.config_set = config_set
        self.configs = config_set.plain
        self.masked_configs = config_set.masked
        self.feature_configs = {"WARP_SPECIALIZE": config_set.warp_specialize} if config_set.warp_specialize else {}
        self.fp32_configs = config_set.fp32
        self.interpret_blocks = config_set.interpret_blocks
        self._forced = None
        self.tuned = None
        if autotune_enabled():
            keys = [k for k in TUNE_KEYS if k in kernel.arg_names]
            zero = _zero_before_each_trial(reset_to_zero) if reset_to_zero else None
            self.tuned = triton.autotune(configs=self._all_configs(), key=keys,
                                         prune_configs_by={"early_config_prune": self._prune}, pre_hook=zero)(kernel)

    @contextlib.contextmanager
    def forced(self, config):
        """Launches inside the block run ``config`` (a (BLOCK_M, BLOCK_N, warps, stages)
        tuple) on the GPU, whatever the tables and the autotuner say; the interpreter and
        fp32 inputs keep their own. For benchmark sweeps; restored on exit."""
        previous, self._forced = self._forced, tuple(config)
        try:
            yield
        finally:
            self._forced = previous

    def _candidates(self, block_d: int):
        return self.configs.get(block_d, self.configs[128])

    def _feature_candidates(self, block_d: int, meta):
        """The candidates of the first feature ``meta`` turns on, or None."""
        for name, table in self.feature_configs.items():
            if meta.get(name):
                return table.get(block_d, table[128])
        return None

    def _all_configs(self):
        seen, out = set(), []
        tables = [self.configs, self.masked_configs, *self.feature_configs.values()]
        for candidates in [c for table in tables for c in table.values()]:
            for cfg in candidates:
                if cfg not in seen:
                    seen.add(cfg)
                    bm, bn, w, s = cfg
                    out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s))
        return out

    def _prune(self, configs, named_args, **kwargs):
        # Triton calls early_config_prune(configs, named_args, **kwargs) (3.6 .. 3.9):
        # named_args holds the positional arguments, kwargs the constexpr keywords.
        def arg(name):
            return kwargs.get(name, named_args.get(name))

        bd = max(arg("BLOCK_D"), arg("BLOCK_DV") or 0)  # the configs of the wider head dim
        allowed = self._allowed(bd, {name: arg(name) for name in (*self.feature_configs, "VARLEN", "SPLIT", "WINDOW")})
        keep = [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed]
        return keep or configs[:1]

    @staticmethod
    def masked(meta) -> bool:
        """Whether a launch with these constexprs takes the masked configs."""
        return bool(meta.get("VARLEN") or meta.get("SPLIT") == 2 or meta.get("WINDOW"))

    def default(self, block_d: int, masked: bool = False, meta=None):
        """The config a launch runs without autotuning; ``meta``: its constexprs (for the
        feature configs)."""
        featured = self._feature_candidates(block_d, meta or {})
        if featured is not None:
            return featured[0]
        if masked and block_d in self.masked_configs:
            return self.masked_configs[block_d][0]
        return self._candidates(block_d)[0]

    def tuned_configs(self):
        """{autotune key: chosen config} so far (empty when autotuning is off)."""
        if self.tuned is None:
            return {}
        return {str(k): str(v) for k, v in getattr(self.tuned, "cache", {}).items()}

    def choose(self, block_d: int, meta, *, fp32_dot: bool, fp32_inputs: bool, autotune: bool):
        """(config or None when the autotuner chooses, why): the one rule of which config a
        launch runs. A counting launch (COUNT) never autotunes: every trial would add its
        visits."""
        if fp32_dot:
            return (*self.interpret_blocks, 4, 1), "the interpreter's small tiles"
        if fp32_inputs and self.fp32_configs:
            return self.fp32_configs.get(block_d, self.fp32_configs[128]), "fp32 inputs: the one tf32x3 config"
        if self._forced is not None:
            return self._forced, "forced by a benchmark (TunedLauncher.forced)"
        default = self.default(block_d, self.masked(meta), meta)
        if autotune and not meta.get("COUNT"):
            return None, (f"autotuned once per call class over {len(self._allowed(block_d, meta))} candidates; "
                          f"{TRITON_AUTOTUNE.name}=0 runs the default")
        if self._feature_candidates(block_d, meta) is not None:
            return default, "the default of the enabled feature's configs"
        if self.masked(meta) and block_d in self.masked_configs:
            return default, "the masked default (documents, per-token layout or window)"
        return default, "the default"

    def _allowed(self, block_d: int, meta):
        allowed = self._feature_candidates(block_d, meta)
        if allowed is None:
            allowed = list(self._candidates(block_d)) + (self.masked_configs.get(block_d, [])
                                                         if self.masked(meta) else [])
        return allowed

    def __call__(self, grid, args, meta, block_d: int, fp32_dot: bool, fp32_inputs: bool = False, *,
                 plan=None, switches=()):
        """grid(BLOCK_M, BLOCK_N) -> launch grid. block_d: the wider padded head dim (q/k or
        v). Returns the (BLOCK_M, BLOCK_N, num_warps, num_stages) it ran, None when the
        autotuner chose. ``plan`` (a list): append this launch's LaunchPlan (with the
        ``switches`` records of its features) and launch nothing."""
        autotune = self.tuned is not None if plan is None else plan_autotunes(fp32_dot)
        config, why = self.choose(block_d, meta, fp32_dot=fp32_dot, fp32_inputs=fp32_inputs, autotune=autotune)
        if plan is not None:
            default = self.default(block_d, self.masked(meta), meta)
            shown = config or default
            plan.append(LaunchPlan(kernel=getattr(self.kernel, "fn", self.kernel).__name__,
                                   grid=tuple(grid(*shown[:2])), config=config, default=default, config_why=why,
                                   switches=tuple(switches),
                                   constexprs={k: v for k, v in meta.items() if k not in ("FP32_DOT", "PRECISION")}))
            return config
        if config is None:
            self.tuned[lambda META: grid(META["BLOCK_M"], META["BLOCK_N"])](*args, **meta)
            return None
        bm, bn, w, s = config
        self.kernel[grid(bm, bn)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        return bm, bn, w, s
