"""Static performance report of the Triton attention kernels, without a GPU.

Compiles the default config of every kernel x layout (and x attention variant: window band,
softcap, sinks, a value head dim of half the head dim) for Hopper (sm_90, Triton's bundled
ptxas; no GPU needed) and prints, per build: tile (BLOCK_M x BLOCK_N), warps/stages,
registers, spills, static shared memory, HGMMA (wgmma) count, and the SASS of the inner
loop(s): instructions per iteration of the main (unmasked) loop, its HGMMA, global loads,
integer divisions and int64 arithmetic.

    python bench/sass_report.py                       # the kernels of this checkout
    python bench/sass_report.py --repo /tmp/sass_base # another checkout (e.g. a worktree of HEAD)
    python bench/sass_report.py --jobs 2 --json out.json --kernels fwd,dq
    python bench/sass_report.py --compare before.json  # a refactor's gate: every build identical

Loops are found in the SASS (nvdisasm of the cubin) as natural loops of its control-flow
graph (a back edge: a branch to a block that dominates it). An "HGMMA loop" is one whose
body holds an HGMMA; the innermost ones are listed in address order, and the first is
taken as the main loop (the kernels visit the unmasked key/query blocks first, and ptxas
keeps source order). "loop instrs" counts the instructions of that loop's blocks, cold
out-of-line blocks of the loop included (barrier wait retries: a few instructions).

`check_limits(rows)` returns the violations of the limits CI holds the kernels to (no
spills in 16-bit default configs; the buffer-layout loop within 15% of the plain one).
"""

import argparse
import collections
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_REPO = os.path.dirname(HERE)

# ============================================================================================
# THE REPORT'S TABLE: which kernel builds, for which layout, with which constexprs.
#
# LAYOUTS: layout or variant name -> constexpr overrides (or a function of the head dim
# returning them). A constexpr the kernel does not declare skips that (kernel, layout) row
# with a note (e.g. a new addressing constexpr on an old checkout, or SINKS, which only the
# forward has). The variants are built on the plain layout as their launches run them (a
# window band with CAUSAL off: the host folds causal into the band).
# ROWS: (short name, module of the package ulysses_kernels.triton, kernel attribute or None
# for the kernel of the module's `_launch`, layouts (names of LAYOUTS, or a dict of its
# own name -> overrides), config chooser[, constexprs for every layout of the row, e.g.
# {"DQ_ATOMIC": False}; dropped with a note where the kernel does not declare them, so an
# older checkout still builds]). A missing module or kernel skips its rows with a note; a
# constexpr without a default that nothing sets fails that build ("constexpr X not set").
# The chooser maps (module, block_d, dtype, constexprs) to (BLOCK_M, BLOCK_N or None,
# num_warps, num_stages).
# LIMIT_PAIRS: (layout, reference layout) whose main-loop instruction counts check_limits
# compares (ratio <= LOOP_RATIO_LIMIT).
# ============================================================================================
LAYOUTS = {
    "plain": dict(VARLEN=False, SPLIT=0),
    "buffer": dict(VARLEN=False, SPLIT=1),        # all-to-all buffer, affine tiles (even blocks)
    "buffer/token": dict(VARLEN=False, SPLIT=2),  # all-to-all buffer, per-token fallback (uneven)
    "varlen": dict(VARLEN=True, SPLIT=0),         # packed documents (batch 1: any buffer reads as plain)
    "window": dict(VARLEN=False, SPLIT=0, CAUSAL=False, WINDOW=True),  # sliding window / band
    "softcap": dict(VARLEN=False, SPLIT=0, SOFTCAP=True),              # c * tanh(s / c) scores
    "sinks": dict(VARLEN=False, SPLIT=0, SINKS=True),                  # sink logits (forward only)
    # v with half the head dim (MLA-like Dv != D)
    "dv=d/2": lambda head_dim: dict(VARLEN=False, SPLIT=0, HEAD_DIM_V=head_dim // 2,
                                    BLOCK_DV=max(16, 1 << (head_dim // 2 - 1).bit_length())),
}


def launcher_default(module, block_d, dtype, consts, launch_name="_launch"):
    """The config the kernel's TunedLauncher runs when autotuning is off."""
    launch = getattr(module, launch_name)
    if dtype == "fp32" and getattr(launch, "fp32_configs", None):
        return launch.fp32_configs.get(block_d, launch.fp32_configs[128])
    # (TunedLauncher.masked on a checkout that has it; the VARLEN / SPLIT=2 rule before it.)
    masked = getattr(launch, "masked", lambda c: bool(c.get("VARLEN") or c.get("SPLIT") == 2))
    try:
        return launch.default(block_d, masked(consts), meta=consts)  # feature configs (WARP_SPECIALIZE)
    except TypeError:  # an older checkout
        return launch.default(block_d, masked(consts))


def atomic_default(module, block_d, dtype, consts):
    """The atomic-dQ (5-GEMM, default) backward's launcher."""
    return launcher_default(module, block_d, dtype, consts, "_launch_atomic")


def preprocess_default(module, block_d, dtype, consts):
    """flash_bwd_preprocess.launch_preprocess (no BLOCK_N; Triton's default 3 stages)."""
    return (128 if block_d <= 128 else 64), None, (4 if block_d <= 64 else 8), 3


ALL = ("plain", "buffer", "buffer/token", "varlen")
VARIANTS = ("window", "softcap", "sinks", "dv=d/2")
ROWS = [
    ("fwd", "flash_fwd", "_flash_fwd_kernel", ALL + VARIANTS, launcher_default),
    ("bwd_atomic", "flash_bwd_dkdv", "_flash_bwd_dkdv_kernel", ALL + VARIANTS, atomic_default,
     {"DQ_ATOMIC": True, "KV_ATOMIC": False}),
    ("bwd_dkdv", "flash_bwd_dkdv", "_flash_bwd_dkdv_kernel", ALL + VARIANTS, launcher_default,
     {"DQ_ATOMIC": False, "KV_ATOMIC": False}),
    ("bwd_dq", "flash_bwd_dq", "_flash_bwd_dq_kernel", ALL + VARIANTS, launcher_default),
    ("bwd_pre", "flash_bwd_preprocess", "_flash_bwd_preprocess_kernel",
     {"plain": dict(SPLIT=0), "buffer": dict(SPLIT=1), "buffer/token": dict(SPLIT=2)}, preprocess_default),
]
# The forward's Hopper features (ulysses_kernels/triton/features.py) as launches combine them (each
# builds on desc; "hopper" is features.HOPPER; varlen drops warp_specialize), on the layouts
# they apply to; "noncausal" rows are the plain layout without the causal mask.
_DESC = dict(KV_DESC=True)
_FMA = dict(KV_DESC=True, FMA_SCALE=True)
_HOPPER = dict(KV_DESC=True, FMA_SCALE=True, WARP_SPECIALIZE=True)
FWD_FEATURE_LAYOUTS = {
    "noncausal": dict(VARLEN=False, SPLIT=0, CAUSAL=False),
    "plain+desc": dict(VARLEN=False, SPLIT=0, **_DESC),
    "buffer+desc": dict(VARLEN=False, SPLIT=1, **_DESC),
    "plain+desc+fma": dict(VARLEN=False, SPLIT=0, **_FMA),
    "noncausal+desc+fma": dict(VARLEN=False, SPLIT=0, CAUSAL=False, **_FMA),
    "buffer+desc+fma": dict(VARLEN=False, SPLIT=1, **_FMA),
    "plain+desc+fma+lazy": dict(VARLEN=False, SPLIT=0, LAZY_RESCALE=True, **_FMA),
    "plain+desc+ws": dict(VARLEN=False, SPLIT=0, WARP_SPECIALIZE=True, **_DESC),
    "plain+hopper": dict(VARLEN=False, SPLIT=0, **_HOPPER),
    "noncausal+hopper": dict(VARLEN=False, SPLIT=0, CAUSAL=False, **_HOPPER),
    "buffer+hopper": dict(VARLEN=False, SPLIT=1, **_HOPPER),
    "varlen+desc+fma": dict(VARLEN=True, SPLIT=0, **_FMA),
    "window+hopper": dict(VARLEN=False, SPLIT=0, CAUSAL=False, WINDOW=True, **_HOPPER),
    "softcap+desc+ws": dict(VARLEN=False, SPLIT=0, SOFTCAP=True, WARP_SPECIALIZE=True, **_DESC),
    "sinks+hopper": dict(VARLEN=False, SPLIT=0, SINKS=True, **_HOPPER),
    "dv=d/2+hopper": lambda head_dim: dict(LAYOUTS["dv=d/2"](head_dim), **_HOPPER),
}
ROWS.append(("fwd_hopper", "flash_fwd", "_flash_fwd_kernel", FWD_FEATURE_LAYOUTS, launcher_default))


def fixed(config):
    """A chooser that builds one (BLOCK_M, BLOCK_N, num_warps, num_stages) config."""
    return lambda module, block_d, dtype, consts: config


# The atomic backward's candidates with query tiles of 64 rows (N >= 64 for every wgmma)
# and the dQ reduce-add through a TMA descriptor (DQ_REDUCE), at the default tile too.
_ATOMIC = {"DQ_ATOMIC": True, "KV_ATOMIC": False}
_BWD_CANDIDATE_LAYOUTS = {"plain": dict(VARLEN=False, SPLIT=0), "buffer": dict(VARLEN=False, SPLIT=1),
                          "plain+dq_reduce": dict(VARLEN=False, SPLIT=0, DQ_REDUCE=True),
                          "noncausal+dq_reduce": dict(VARLEN=False, SPLIT=0, CAUSAL=False, DQ_REDUCE=True)}
ROWS += [
    ("bwd_atomic+dq_reduce", "flash_bwd_dkdv", "_flash_bwd_dkdv_kernel",
     {name: lay for name, lay in _BWD_CANDIDATE_LAYOUTS.items() if "dq_reduce" in name}, atomic_default, _ATOMIC),
    ("bwd_atomic@64x64", "flash_bwd_dkdv", "_flash_bwd_dkdv_kernel", _BWD_CANDIDATE_LAYOUTS, fixed((64, 64, 8, 2)),
     _ATOMIC),
    ("bwd_atomic@64x128", "flash_bwd_dkdv", "_flash_bwd_dkdv_kernel", _BWD_CANDIDATE_LAYOUTS,
     fixed((64, 128, 8, 2)), _ATOMIC),
]
# The warp-specialized dK/dV kernel (features "bwd_warp_specialize": dK/dV only, then the dQ
# kernel), on the 4-warp 64-row tiles its launcher takes.
_WS = dict(WARP_SPECIALIZE=True)
ROWS.append(("bwd_dkdv+ws", "flash_bwd_dkdv", "_flash_bwd_dkdv_kernel", {
    "plain": dict(VARLEN=False, SPLIT=0, **_WS), "buffer": dict(VARLEN=False, SPLIT=1, **_WS),
    "noncausal": dict(VARLEN=False, SPLIT=0, CAUSAL=False, **_WS),
    "window": dict(VARLEN=False, SPLIT=0, CAUSAL=False, WINDOW=True, **_WS),
    "softcap": dict(VARLEN=False, SPLIT=0, SOFTCAP=True, **_WS),
    "dv=d/2": lambda head_dim: dict(LAYOUTS["dv=d/2"](head_dim), **_WS)},
    launcher_default, {"DQ_ATOMIC": False, "KV_ATOMIC": False}))
ROWS.append(("bwd_dq+ws", "flash_bwd_dq", "_flash_bwd_dq_kernel", {
    "plain": dict(VARLEN=False, SPLIT=0, **_WS), "buffer": dict(VARLEN=False, SPLIT=1, **_WS),
    "noncausal": dict(VARLEN=False, SPLIT=0, CAUSAL=False, **_WS),
    "window": dict(VARLEN=False, SPLIT=0, CAUSAL=False, WINDOW=True, **_WS),
    "softcap": dict(VARLEN=False, SPLIT=0, SOFTCAP=True, **_WS)}, launcher_default))
# Rows of candidates, not defaults: check_limits holds them to building, not to their spills.
CANDIDATES = {"fwd_hopper", "bwd_atomic+dq_reduce", "bwd_atomic@64x64", "bwd_atomic@64x128", "bwd_dkdv+ws",
              "bwd_dq+ws"}
LIMIT_PAIRS = [("buffer", "plain")]
# Signature: pointers are the all-uppercase runtime arguments (LSE, DELTA, SINK and *_ACC
# fp32; DOCS, CU, COUNTS int32; the rest the data type), except these uppercase integer
# scalars (any argument declared do_not_specialize is taken as a scalar too). Lowercase
# scalars are int32, but fp32 where the name holds "scale" or starts with "softcap".
SCALAR_ARGS = {"B", "P", "HQ", "HKV", "GROUP", "TUNE_KEY"}
LOOP_RATIO_LIMIT = 1.15
# ============================================================================================

def _tool(name):
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


# --------------------------------------------------------------------------------------------
# Importing the kernels of a given checkout
# --------------------------------------------------------------------------------------------
def kernel_folder(repo):
    """The folder of checkout `repo` that holds the Triton kernels, relative to it."""
    old = os.path.join(repo, "triton_kernels")
    return "triton_kernels" if os.path.isdir(old) else os.path.join("ulysses_kernels", "triton")


def use_repo(repo):
    """Make `ulysses_kernels.triton.<module>` import the kernel modules of checkout `repo`.

    pyproject.toml maps the package ulysses_kernels.triton to the folder ulysses_kernels/triton/. Both
    packages are registered as bare namespace stubs over the checkout's folders, so their
    __init__ (the torch op registrations, the whole public API) never runs: only the
    kernel modules and what they import (ulysses_kernels.env) load.
    """
    repo = os.path.abspath(repo)
    os.environ.setdefault("ULYSSES_KERNELS_TRITON_AUTOTUNE", "0")
    os.environ["TRITON_INTERPRET"] = "0"
    for name in [m for m in sys.modules if m == "ulysses_kernels" or m.startswith("ulysses_kernels.")]:
        del sys.modules[name]
    for name, folder in (("ulysses_kernels", "ulysses_kernels"), ("ulysses_kernels.triton", kernel_folder(repo))):
        path = os.path.join(repo, folder)
        if not os.path.isdir(path):
            raise SystemExit(f"{path} not found: --repo must be a checkout of ulysses-kernels")
        module = types.ModuleType(name)
        module.__path__ = [path]
        module.__file__ = os.path.join(path, "__init__.py")
        module.__package__ = name
        sys.modules[name] = module
    sys.modules["ulysses_kernels"].triton = sys.modules["ulysses_kernels.triton"]


def _import_kernel_module(name):
    import importlib

    try:
        return importlib.import_module("ulysses_kernels.triton." + name), None
    except ModuleNotFoundError as error:
        if error.name == "ulysses_kernels.triton." + name:
            return None, "no module " + name
        return None, "import failed: %s" % error
    except Exception as error:  # noqa: BLE001 - a checkout mid-edit: report, build the rest
        return None, "import failed: %s: %s" % (type(error).__name__, error)


# --------------------------------------------------------------------------------------------
# Signature of an ahead-of-time build
# --------------------------------------------------------------------------------------------
DATA_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def pointer_type(name, dtype):
    """fp32 side tensors, int32 document tables and counters, else the data type (see
    SCALAR_ARGS)."""
    if name in ("LSE", "DELTA", "SINK") or name.endswith("_ACC"):
        return "*fp32"
    if name in ("DOCS", "CU", "COUNTS"):
        return "*i32"
    return DATA_TYPES[dtype]


def scalar_type(name):
    """fp32 for the scales and the softcap factors, else int32."""
    return "fp32" if "scale" in name or name.startswith("softcap") else "i32"


def tuple_fields(kernel):
    """{tuple parameter: its field names}, read from the kernel body's unpacking statements
    (``Sq, Sk, B, P = sizes``): each kernel unpacks its tuple parameters at its top, so their
    fields are typed by the same name rules as plain parameters (an older checkout has none)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    params = {p.name for p in kernel.params}
    fields = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.value, ast.Name) and node.value.id in params):
            fields[node.value.id] = [element.id for element in node.targets[0].elts]
    return fields


def _runtime_type(name, dtype, do_not_specialize):
    """(type, constexpr value or None, divisibility-16 attribute?) of one runtime argument
    as the launcher specializes it: strides of the last dim (``*_d``) are 1, pointers and
    the batch/seq/head strides divisible by 16, unless declared do_not_specialize."""
    if name.endswith("_d") and not do_not_specialize:
        return "constexpr", 1, False
    if name.isupper() and name not in SCALAR_ARGS and not do_not_specialize:
        return pointer_type(name, dtype), None, True
    aligned = name.endswith(("_s", "_h", "_b")) and not do_not_specialize
    return scalar_type(name), None, aligned


def build_signature(kernel, consts, dtype):
    """(signature, constexprs, attrs) as the launcher's call would specialize them.

    Constexpr parameters take `consts` (else their default); runtime arguments, and each
    field of a tuple parameter (keyed by its path), follow _runtime_type. Raises KeyError
    for a missing constexpr.
    """
    import inspect

    sig, values, attrs = {}, {}, {}
    fields = tuple_fields(kernel)
    for p in kernel.params:
        n = p.name
        if p.is_constexpr:
            if n in consts:
                values[n] = consts[n]
            elif p._param.default is not inspect.Parameter.empty:
                values[n] = p._param.default
            else:
                raise KeyError(n)
            sig[n] = "constexpr"
            continue
        names = fields.get(n)
        paths = [(p.num, j) for j in range(len(names))] if names else [(p.num,)]
        types = []
        for path, name in zip(paths, names or [n]):
            kind, value, aligned = _runtime_type(name, dtype, p.do_not_specialize)
            types.append(kind)
            if value is not None:
                values[path if names else n] = value
            if aligned:
                attrs[path] = [["tt.divisibility", 16]]
        sig[n] = tuple(types) if names else types[0]
    return sig, values, attrs


# --------------------------------------------------------------------------------------------
# SASS analysis
# --------------------------------------------------------------------------------------------
_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_\w+):")
_TARGET = re.compile(r"`\((\.L_\w+)\)")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at)?')
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")


class Instr:
    __slots__ = ("addr", "op", "text", "pred", "target", "site")

    def __init__(self, addr, text, site=None):
        self.addr = addr
        self.pred = bool(_PRED.match(text))
        self.text = _PRED.sub("", text)
        self.op = self.text.split()[0] if self.text else ""
        t = _TARGET.search(self.text)
        self.target = t.group(1) if t else None
        self.site = site


def parse_sass(text):
    """Instructions (with branch targets resolved to addresses) of nvdisasm/cuobjdump text.

    With line info (nvdisasm -gi), each instruction's `site` is its outermost source
    location ("file.py:line"), i.e. the call site in the kernel body of inlined code.
    """
    instrs, labels, pending, site = [], {}, [], None
    for line in text.splitlines():
        m = _LINE.search(line)
        if m:
            # The last "//## File" line before an instruction is the outermost frame.
            site = "%s:%s" % (os.path.basename(m.group(1)), m.group(2))
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            ins = Instr(int(m.group(1), 16), m.group(2), site)
            for lab in pending:
                labels[lab] = ins.addr
            pending = []
            instrs.append(ins)
            site = None
    for ins in instrs:
        if ins.target is not None:
            ins.target = labels.get(ins.target)
    return instrs


def _is_branch(ins):
    return ins.op.split(".")[0] in ("BRA", "JMP", "BRX", "JMX")


def _ends_block(ins):
    base = ins.op.split(".")[0]
    return _is_branch(ins) or base in ("EXIT", "RET", "KILL")


def basic_blocks(instrs):
    """[(start index, end index exclusive)], successors as block indices."""
    if not instrs:
        return [], []
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    leaders = {0}
    for i, ins in enumerate(instrs):
        if _is_branch(ins) and ins.target in index and ins.op.split(".")[0] == "BRA":
            leaders.add(index[ins.target])
        if _ends_block(ins) and i + 1 < len(instrs):
            leaders.add(i + 1)
    starts = sorted(leaders)
    blocks = [(s, e) for s, e in zip(starts, starts[1:] + [len(instrs)])]
    block_of = {s: b for b, (s, _) in enumerate(blocks)}
    succ = []
    for b, (s, e) in enumerate(blocks):
        last = instrs[e - 1]
        out = []
        base = last.op.split(".")[0]
        if base == "BRA" and last.target in index:
            out.append(block_of[index[last.target]])
        falls = not _ends_block(last) or last.pred
        if falls and b + 1 < len(blocks):
            out.append(b + 1)
        succ.append(sorted(set(out)))
    return blocks, succ


def dominators(succ, entry=0):
    """Iterative dominator sets of the blocks reachable from `entry` (small graphs)."""
    n = len(succ)
    pred = [[] for _ in range(n)]
    for b, out in enumerate(succ):
        for s in out:
            pred[s].append(b)
    reach, stack = {entry}, [entry]
    while stack:
        for s in succ[stack.pop()]:
            if s not in reach:
                reach.add(s)
                stack.append(s)
    order = sorted(reach)
    dom = {b: set(reach) for b in order}
    dom[entry] = {entry}
    changed = True
    while changed:
        changed = False
        for b in order:
            if b == entry:
                continue
            ps = [dom[p] for p in pred[b] if p in reach]
            new = set.intersection(*ps) if ps else set()
            new = new | {b}
            if new != dom[b]:
                dom[b] = new
                changed = True
    return dom, pred


def find_loops(instrs):
    """Natural loops: [{"header": addr, "blocks": set, "instrs": [Instr]}], by header."""
    blocks, succ = basic_blocks(instrs)
    if not blocks:
        return []
    dom, pred = dominators(succ)
    bodies = collections.defaultdict(set)
    for u in dom:
        for h in succ[u]:
            if h in dom[u]:  # back edge u -> h
                body, stack = {h, u}, [u]
                while stack:
                    x = stack.pop()
                    if x == h:
                        continue
                    for p in pred[x]:
                        if p not in body and p in dom:
                            body.add(p)
                            stack.append(p)
                bodies[h] |= body
    loops = []
    for h, body in sorted(bodies.items()):
        body_instrs = [instrs[i] for b in sorted(body) for i in range(*blocks[b])]
        loops.append({"header": instrs[blocks[h][0]].addr, "blocks": body, "instrs": body_instrs})
    return loops


def _is_hgmma(ins):
    return ins.op.startswith("HGMMA")


def count_ops(instrs):
    """The instruction classes the report shows (counts)."""
    c = collections.Counter()
    for ins in instrs:
        op = ins.op
        base = op.split(".")[0]
        c["instrs"] += 1
        c["hgmma"] += _is_hgmma(ins)
        c["gload"] += base in ("LDG", "LDGSTS") or base.startswith(("UTMALDG", "UBLKCP"))
        c["gstore"] += base in ("STG", "RED", "REDG", "ATOMG") or base.startswith(("UTMASTG", "UTMAREDG"))
        c["setmaxreg"] += base == "USETMAXREG"  # warp specialization's register reallocation
        c["sload"] += base in ("LDS", "LDSM")
        # An integer division: I2F(.U32).RP + MUFU.RCP + F2I ... (the reciprocal setup).
        c["idiv"] += base == "I2F" and ".RP" in op
        c["cvt"] += base in ("I2F", "F2I", "I2FP", "F2IP")
        # int64 arithmetic: IMAD.WIDE, and the carry halves (.X: IADD3.X, LEA.HI.X, IMAD.X, ...).
        c["wide"] += op.startswith("IMAD.WIDE") or "X" in op.split(".")[1:]
        c["spill"] += base in ("STL", "LDL")
        c["call"] += base == "CALL"
    return c


def analyze_sass(text, source_dir=None):
    """Counts of the whole kernel and of its HGMMA loops (innermost, address order).

    Each loop gets `site` (its most frequent outermost source line: the call of the inlined
    loop function in the kernel body) and `masked` (the MASKED argument of that call, read
    from the source in `source_dir`, or None when unknown).
    """
    instrs = parse_sass(text)
    total = count_ops(instrs)
    loops = [lp for lp in find_loops(instrs) if any(_is_hgmma(i) for i in lp["instrs"])]
    # Innermost: drop a loop that contains another HGMMA loop.
    inner = [lp for lp in loops
             if not any(o is not lp and o["blocks"] < lp["blocks"] for o in loops)]
    out = []
    for lp in sorted(inner, key=lambda lp: lp["header"]):
        c = count_ops(lp["instrs"])
        sites = collections.Counter(i.site for i in lp["instrs"] if i.site)
        site = sites.most_common(1)[0][0] if sites else None
        out.append(dict(header=lp["header"], site=site, masked=masked_at(source_dir, site), **c))
    return {"total": dict(total), "loops": out}


def main_loop_index(loops):
    """The main loop: the first one whose call passes MASKED=False; else the smallest
    (the masked phases add the mask arithmetic to the same body)."""
    if not loops:
        return None
    for i, lp in enumerate(loops):
        if lp.get("masked") is False:
            return i
    return min(range(len(loops)), key=lambda i: loops[i]["instrs"])


_AST_CACHE = {}


def masked_at(source_dir, site):
    """Value of the MASKED argument (a literal True/False) of the call at `site`
    ("file.py:line") in `source_dir`, or None."""
    import ast

    if not source_dir or not site:
        return None
    fname, line = site.rsplit(":", 1)
    path = os.path.join(source_dir, fname)
    if path not in _AST_CACHE:
        try:
            with open(path) as f:
                _AST_CACHE[path] = ast.parse(f.read())
        except (OSError, SyntaxError):
            _AST_CACHE[path] = None
    tree, line = _AST_CACHE[path], int(line)
    if tree is None:
        return None
    funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in funcs and n.lineno <= line <= (n.end_lineno or n.lineno)]
    for call in sorted(calls, key=lambda n: (n.end_lineno or n.lineno) - n.lineno):
        params = [a.arg for a in funcs[call.func.id].args.args]
        arg = next((k.value for k in call.keywords if k.arg == "MASKED"), None)
        if arg is None and "MASKED" in params and params.index("MASKED") < len(call.args):
            arg = call.args[params.index("MASKED")]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, bool):
            return arg.value
    return None


# --------------------------------------------------------------------------------------------
# One build (runs in a worker process)
# --------------------------------------------------------------------------------------------
_LOADED_REPO = None


def compile_one(job):
    """Build one kernel config for sm_90 and analyze it; returns a result dict."""
    global _LOADED_REPO
    if _LOADED_REPO != job["repo"]:
        use_repo(job["repo"])
        _LOADED_REPO = job["repo"]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {k: job[k] for k in ("name", "module", "kernel", "layout", "dtype", "block_m", "block_n", "warps",
                               "stages")}
    module, _ = _import_kernel_module(job["module"])
    kernel = getattr(module, job["kernel"])
    try:
        sig, consts, attrs = build_signature(kernel, job["consts"], job["dtype"])
    except KeyError as missing:
        out["error"] = "constexpr %s not set" % missing
        return out
    start = time.time()
    try:
        c = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": job["warps"], "num_stages": job["stages"]})
    except Exception as error:  # noqa: BLE001 - reported in the table
        lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
        out["error"] = "%s: %s" % (type(error).__name__, (lines[-1] if lines else "")[:200])
        return out
    out["compile_s"] = round(time.time() - start, 2)
    ptx = c.asm["ptx"]
    out["wgmma_ptx"] = ptx.count("wgmma.mma_async")
    out["mma_sync_ptx"] = ptx.count("mma.sync")
    out["smem"] = int(c.metadata.shared)
    out["regs"] = getattr(c, "n_regs", None)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(c.asm["cubin"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
        if m:
            out["regs"], out["stack"], out["local"] = int(m.group(1)), int(m.group(2)), int(m.group(4))
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-gi", cubin], capture_output=True, text=True).stdout
        if job.get("ptxas_log"):
            out.update(ptxas_spills(ptx, tmp))
    if job.get("sass_dir"):
        os.makedirs(job["sass_dir"], exist_ok=True)
        layout = re.sub(r"[^A-Za-z0-9_.-]", "_", job["layout"])  # "buffer/token", "dv=d/2": one file name
        with open(os.path.join(job["sass_dir"], "%s_%s_%s.sass" % (job["name"], layout, job["dtype"])), "w") as f:
            f.write(sass)
    analysis = analyze_sass(sass, os.path.join(job["repo"], kernel_folder(job["repo"])))
    out["total"] = analysis["total"]
    out["loops"] = analysis["loops"]
    return out


def ptxas_spills(ptx, tmp):
    """Spill stores/loads (bytes) from `ptxas -v` on the PTX, as Triton runs it."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    src = os.path.join(tmp, "k.ptx")
    with open(src, "w") as f:
        f.write(ptx)
    log = subprocess.run([_tool("ptxas"), "-lineinfo", "-v", "--regAllocOptLevel=2",
                          "--gpu-name=" + sm_arch_from_capability(90), src, "-o", os.path.join(tmp, "v.o")],
                         capture_output=True, text=True).stderr
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"spill_stores": int(m.group(1)), "spill_loads": int(m.group(2))} if m else {}


# --------------------------------------------------------------------------------------------
# Jobs, table, limits
# --------------------------------------------------------------------------------------------
def plan_jobs(repo, head_dim, dtype, kernels=None, sass_dir=None, ptxas_log=False):
    """(jobs, notes): one job per (kernel, layout) of ROWS that exists in `repo`."""
    use_repo(repo)
    try:
        from ulysses_kernels.triton.kernel_call import block_d
    except ImportError:  # a checkout from before the split of triton/_common.py (a baseline)
        from ulysses_kernels.triton._common import block_d

    bd = block_d(head_dim)
    precision = "tf32" if dtype != "fp32" else ("tf32x3" if bd <= 128 else "tf32")
    base = dict(HEAD_DIM=head_dim, BLOCK_D=bd, HEAD_DIM_V=head_dim, BLOCK_DV=bd, CAUSAL=True, FP32_DOT=False,
                PRECISION=precision)
    jobs, notes = [], []
    for name, mod_name, attr, layouts, chooser, *extra in ROWS:
        row_consts = extra[0] if extra else {}
        if kernels and name not in kernels and mod_name not in kernels:
            continue
        module, why = _import_kernel_module(mod_name)
        if module is None:
            notes.append("%s: skipped (%s)" % (name, why))
            continue
        kernel = getattr(module, attr) if attr else getattr(getattr(module, "_launch", None), "kernel", None)
        if kernel is None:
            notes.append("%s: skipped (no kernel %s in %s)" % (name, attr or "_launch.kernel", mod_name))
            continue
        params = {p.name for p in kernel.params if p.is_constexpr}
        dropped = sorted(set(row_consts) - params)
        if dropped:
            notes.append("%s: %s not constexprs of %s (dropped)" % (name, ", ".join(dropped), kernel.fn.__name__))
            row_consts = {k: v for k, v in row_consts.items() if k in params}
        mine = []
        for layout in layouts:
            overrides = layouts[layout] if isinstance(layouts, dict) else LAYOUTS[layout]
            if callable(overrides):
                overrides = overrides(head_dim)
            overrides = dict(overrides, **row_consts)
            unknown = sorted(set(overrides) - params)
            if unknown:
                notes.append("%s %s: skipped (not a constexpr of %s: %s)" % (name, layout, kernel.fn.__name__,
                                                                            ", ".join(unknown)))
                continue
            consts = dict(base, **overrides)
            bm, bn, w, s = chooser(module, bd, dtype, consts)
            consts["BLOCK_M"] = bm
            if bn is not None:
                consts["BLOCK_N"] = bn
            consts = {k: v for k, v in consts.items() if k in params}
            mine.append(dict(repo=os.path.abspath(repo), name=name, module=mod_name, kernel=kernel.fn.__name__,
                             layout=layout, dtype=dtype, consts=consts, block_m=bm, block_n=bn, warps=w,
                             stages=s, sass_dir=sass_dir, ptxas_log=ptxas_log, reference_of=None))
        # A reference layout whose default tile differs from the compared layout's is also
        # built with that layout's config, so the loop ratio compares equal tiles.
        by_layout = {j["layout"]: j for j in mine}
        for lay, ref in LIMIT_PAIRS:
            a, b = by_layout.get(lay), by_layout.get(ref)
            cfg = ("block_m", "block_n", "warps", "stages")
            if a and b and any(a[k] != b[k] for k in cfg):
                extra = dict(b, layout="%s@%s" % (ref, lay), reference_of=lay, **{k: a[k] for k in cfg})
                extra["consts"] = dict(b["consts"], BLOCK_M=a["block_m"])
                if a["block_n"] is not None:
                    extra["consts"]["BLOCK_N"] = a["block_n"]
                mine.append(extra)
        jobs += mine
    return jobs, notes


def run_jobs(jobs, n_jobs):
    if n_jobs <= 1 or len(jobs) <= 1:
        return [compile_one(j) for j in jobs]
    with concurrent.futures.ProcessPoolExecutor(max_workers=n_jobs) as pool:
        # Longest builds first (the backward kernels), for a shorter tail.
        order = sorted(range(len(jobs)), key=lambda i: jobs[i]["module"] == "flash_bwd_preprocess")
        futures = {i: pool.submit(compile_one, jobs[i]) for i in order}
        return [futures[i].result() for i in range(len(jobs))]


def main_loop(row):
    """The main (unmasked) HGMMA loop of a result, or None (see main_loop_index)."""
    loops = row.get("loops") or []
    i = main_loop_index(loops)
    return None if i is None else loops[i]


def spill_bytes(row):
    return max(row.get("stack") or 0, row.get("local") or 0, row.get("spill_stores") or 0)


def loop_ratios(rows, pairs=LIMIT_PAIRS):
    """[(kernel, dtype, layout, reference row's layout, instrs, reference instrs, ratio)].

    The reference is the reference layout built with the compared layout's tile when its
    default tile differs (layout "plain@buffer"), else its default build.
    """
    by = {(r["name"], r["dtype"], r["layout"]): r for r in rows if not r.get("error")}
    out = []
    for (name, dtype, layout), r in sorted(by.items()):
        for lay, ref in pairs:
            if layout != lay:
                continue
            b = by.get((name, dtype, "%s@%s" % (ref, lay))) or by.get((name, dtype, ref))
            if b is None or main_loop(r) is None or main_loop(b) is None:
                continue
            a_n, b_n = main_loop(r)["instrs"], main_loop(b)["instrs"]
            out.append((name, dtype, lay, b["layout"], a_n, b_n, a_n / b_n))
    return out


def spills(r):
    """Whether a build spills registers (stack bytes or STL/LDL instructions)."""
    return bool(spill_bytes(r) or r["total"].get("spill"))


def check_limits(rows, ratio_limit=LOOP_RATIO_LIMIT, pairs=LIMIT_PAIRS):
    """Violations (strings) of: (a) no spills in 16-bit (bf16/fp16) default configs (the
    CANDIDATES rows are reported by candidate_spills instead: a spilling candidate is a
    finding, not a regression); (b) per kernel, each LIMIT_PAIRS layout's main-loop
    instruction count within `ratio_limit` of its reference layout's at the same tile (the
    ratio is in the message). A failed build is a violation too, candidates' included."""
    out = []
    for r in rows:
        if r.get("error"):
            out.append("%s %s: build failed: %s" % (r["name"], r["layout"], r["error"]))
        elif r["dtype"] in ("bf16", "fp16") and not r.get("reference_of") and r["name"] not in CANDIDATES and spills(r):
            out.append("%s %s: spills (stack %s B, %d STL/LDL)" % (r["name"], r["layout"], r.get("stack"),
                                                                     r["total"].get("spill", 0)))
    for name, dtype, lay, ref, a, b, ratio in loop_ratios(rows, pairs):
        if ratio > ratio_limit:
            out.append("%s: %s loop %d instrs = %.2fx %s (%d), limit %.2fx" % (name, lay, a, ratio, ref, b,
                                                                              ratio_limit))
    return out


def candidate_spills(rows):
    """The CANDIDATES builds that spill, as strings (printed with the report)."""
    return ["%s %s: spills (stack %s B, %d STL/LDL)" % (r["name"], r["layout"], r.get("stack"),
                                                       r["total"].get("spill", 0))
            for r in rows if r["name"] in CANDIDATES and not r.get("error") and spills(r)]


COLUMNS = ["kernel", "layout", "tile", "w/s", "regs", "spill B", "smem KiB", "HGMMA", "loop instrs", "loop HGMMA",
           "loop gld", "loop idiv", "loop I2F/F2I", "loop 64-bit", "HGMMA loops (instrs/HGMMA @call site; *main)"]


def table(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        tile = "%sx%s" % (r["block_m"], r["block_n"]) if r["block_n"] else "%s" % r["block_m"]
        if r.get("error"):
            cells = [r["name"], r["layout"], tile, "%d/%d" % (r["warps"], r["stages"]), "error: " + r["error"]]
            cells += [""] * (len(COLUMNS) - len(cells))
        else:
            lp = main_loop(r)
            spill = "%d" % spill_bytes(r)
            if r["total"].get("spill"):
                spill += " (%d STL/LDL)" % r["total"]["spill"]
            if "spill_stores" in r:
                spill += " [ptxas %d/%d]" % (r["spill_stores"], r["spill_loads"])
            loops = ", ".join("%s%d/%d%s" % ("*" if x is lp else "", x["instrs"], x["hgmma"],
                                             " @" + x["site"] if x["site"] else "")
                              for x in r["loops"]) or "-"
            cells = [r["name"], r["layout"], tile, "%d/%d" % (r["warps"], r["stages"]), str(r["regs"]), spill,
                     "%.1f" % (r["smem"] / 1024), str(r["total"]["hgmma"])]
            if lp:
                cells += [str(lp["instrs"]), str(lp["hgmma"]), str(lp["gload"]), str(lp["idiv"]), str(lp["cvt"]),
                          str(lp["wide"])]
            else:
                cells += ["-"] * 6
            cells.append(loops)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(rows, notes, header=""):
    parts = [header] if header else []
    parts.append(table(rows))
    ratios = loop_ratios(rows)
    if ratios:
        parts.append("\nMain-loop instructions, layout vs reference (limit %.2fx):\n" % LOOP_RATIO_LIMIT)
        parts.append("| kernel | dtype | layout | vs | loop instrs | reference | ratio |\n|---|---|---|---|---|---|---|")
        parts += ["| %s | %s | %s | %s | %d | %d | %.2fx |" % r for r in ratios]
    violations = check_limits(rows)
    parts.append("\nLimits: " + ("OK" if not violations else "%d violation(s)" % len(violations)))
    parts += ["- " + v for v in violations]
    candidates = candidate_spills(rows)
    if candidates:
        parts.append("\nCandidates that spill (not defaults, not limit violations):")
        parts += ["- " + v for v in candidates]
    if notes:
        parts.append("\nNotes:")
        parts += ["- " + n for n in notes]
    return "\n".join(parts)


STATUS_COMMAND = "python bench/sass_report.py --status docs/status.md"
STATUS_BEGIN = "<!-- begin: generated by %s; do not edit by hand -->" % STATUS_COMMAND
STATUS_END = "<!-- end: generated -->"


def status_document(rows, notes, *, triton_version, head_dim, dtype, date):
    """The generated section of docs/status.md ("Kernel builds"): the measured side of
    docs/architecture.md's kernel rules, which cite its rows by kernel and layout; no
    timings, no paths."""
    header = "\n".join([
        "Generated by `%s` on %s (regenerate after a kernel or config change, and" % (STATUS_COMMAND, date),
        "compare with `--compare` first: docs/architecture.md, \"Attention kernels\").",
        "",
        "sm_90 machine code of every default config and the listed candidates and features, %s, head dim %d,"
        % (dtype, head_dim),
        "causal unless the layout says otherwise; Triton %s, static (no GPU: `ptxas` and `nvdisasm`)." % triton_version,
        "Columns: registers per thread, spilled bytes, shared memory, HGMMA (wgmma) count, and the main loop's",
        "SASS instructions per key (or query) block; *main marks the loop the limits compare.",
        "",
    ])
    return report(rows, notes, header) + "\n"


def replace_status_section(page: str, section: str) -> str:
    """`page` (docs/status.md, written by hand) with the text between its STATUS_BEGIN and
    STATUS_END markers replaced by `section`; ValueError when the markers are missing, so
    the generator never overwrites the hand-written status and limits."""
    start, end = page.find(STATUS_BEGIN), page.find(STATUS_END)
    if start < 0 or end < start:
        raise ValueError("the status page has no generated section (%s ... %s)" % (STATUS_BEGIN, STATUS_END))
    return page[:start + len(STATUS_BEGIN)] + "\n" + section + page[end:]


# What a refactor may change without changing the machine code: timings, and each loop's
# source line (its call site moves when the file is edited).
_VOLATILE_ROW_FIELDS = ("compile_s",)
_VOLATILE_LOOP_FIELDS = ("site",)


def comparable(rows):
    """{(name, layout, dtype): row without its volatile fields}."""
    out = {}
    for row in rows:
        row = {k: v for k, v in row.items() if k not in _VOLATILE_ROW_FIELDS}
        row["loops"] = [{k: v for k, v in lp.items() if k not in _VOLATILE_LOOP_FIELDS} for lp in row.get("loops", [])]
        out[(row["name"], row["layout"], row["dtype"])] = row
    return out


def compare_reports(before, after):
    """Lines describing each build whose registers, spills, shared memory, instruction counts
    or loops differ between two reports (or that only one has); empty when identical."""
    a, b = comparable(before["rows"]), comparable(after["rows"])
    lines = []
    for key in sorted(set(a) | set(b), key=str):
        if a.get(key) == b.get(key):
            continue
        if key not in a or key not in b:
            lines.append("%s %s %s: only in the %s report" % (*key, "second" if key not in a else "first"))
            continue
        for field in sorted(set(a[key]) | set(b[key])):
            if a[key].get(field) != b[key].get(field):
                lines.append("%s %s %s: %s %s -> %s" % (*key, field, a[key].get(field), b[key].get(field)))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=DEFAULT_REPO, help="checkout whose ulysses_kernels/triton/ to build (default: this one)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DATA_TYPES), default="bf16")
    ap.add_argument("--kernels", default="", help="comma-separated short names or modules (default: all)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="parallel compile processes")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--sass-dir", help="also write each build's SASS (nvdisasm -gi) here")
    ap.add_argument("--ptxas-log", action="store_true", help="rerun ptxas -v for spill store/load bytes (slower)")
    ap.add_argument("--check", action="store_true", help="exit 1 when check_limits finds violations")
    ap.add_argument("--status", metavar="MARKDOWN",
                    help="also write the report into the generated section of this status page (docs/status.md)")
    ap.add_argument("--compare", metavar="BEFORE_JSON",
                    help="after the report, list every build that differs from this earlier --json report "
                         "(a refactor's gate: nothing listed); exit 1 when one does")
    args = ap.parse_args(argv)
    for tool in ("cuobjdump", "nvdisasm"):
        if _tool(tool) is None:
            raise SystemExit("Triton's bundled %s not found (triton/backends/nvidia/bin)" % tool)
    kernels = {k.strip() for k in args.kernels.split(",") if k.strip()}
    start = time.time()
    jobs, notes = plan_jobs(args.repo, args.head_dim, args.dtype, kernels, args.sass_dir, args.ptxas_log)
    rows = run_jobs(jobs, args.jobs)
    elapsed = time.time() - start
    import triton

    header = ("sm_90 static report: %s, D=%d, causal, default configs; Triton %s; %s; %d builds in %.0f s "
              "(%d jobs)\n" % (args.dtype, args.head_dim, triton.__version__, os.path.abspath(args.repo), len(rows),
                               elapsed, args.jobs))
    print(report(rows, notes, header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "triton": triton.__version__,
                       "repo": os.path.abspath(args.repo), "head_dim": args.head_dim, "dtype": args.dtype,
                       "elapsed_s": round(elapsed, 1), "rows": rows, "notes": notes,
                       "violations": check_limits(rows)}, f, indent=1)
    if args.status:
        section = status_document(rows, notes, triton_version=triton.__version__, head_dim=args.head_dim,
                                  dtype=args.dtype, date=datetime.date.today().isoformat())
        with open(args.status) as f:
            page = replace_status_section(f.read(), section)
        with open(args.status, "w") as f:
            f.write(page)
    if args.check and check_limits(rows):
        return 1
    if args.compare:
        with open(args.compare) as f:
            differences = compare_reports(json.load(f), {"rows": rows})
        print("\ncompared with %s: %d builds, %s" % (args.compare, len(rows),
                                                      "identical" if not differences else "differences:"))
        print("\n".join(differences))
        return 1 if differences else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
