"""The CUDA extension (csrc/) seen from the host: op schemas and mutability, build info, the
NCCL engine's host-side errors, and the pack/unpack kernels' index math compiled as host
C++. No kernel is launched on a GPU here; the kernels on a GPU are tested in
tests/fused/test_fused_ops.py (marked `gpu`)."""

import os

import pytest
import torch
from helpers import ROOT, needs_extension

from ulysses_kernels.layout import head_plan_error, place_heads

EXPECTED_SCHEMAS = {
    "build_info": "ulysses_kernels::build_info() -> str",
    "pack_into": ("ulysses_kernels::pack_into(Tensor[] srcs, Tensor(a!) send, int[] offsets, int[] counts, "
                  "int[] local_heads, int[] replicas, Tensor? cos=None, Tensor? sin=None, int[] rotary=[]) -> ()"),
    "unpack_into": ("ulysses_kernels::unpack_into(Tensor recv, Tensor(a!)[] outs, int[] offsets, int[] counts, "
                    "int[] local_heads, int[] replicas) -> ()"),
    "nccl_unique_id": "ulysses_kernels::nccl_unique_id() -> Tensor",
    "nccl_all_to_all": ("ulysses_kernels::nccl_all_to_all(int comm, Tensor send, Tensor(a!) recv, "
                        "int[] send_counts, int[] recv_counts) -> ()"),
}
# The communicator is a class (csrc/nccl_engine.cpp): its constructor and methods.
_SELF = "__torch__.torch.classes.ulysses_kernels.NcclCommunicator _0"
EXPECTED_CLASS_SCHEMAS = [
    f"__init__({_SELF}, Tensor _1, int _2, int _3, int _4, float _5, bool _6) -> NoneType _0",
    f"handle({_SELF}) -> int _0",
    f"wait({_SELF}, float _1) -> NoneType _0",
    f"close({_SELF}) -> NoneType _0",
]


# ------------------------------------------------------------------------ schemas

def test_build_info():
    needs_extension()
    info = torch.ops.ulysses_kernels.build_info()
    assert "cuda=" in info and "nccl=" in info


@pytest.mark.parametrize("name", sorted(EXPECTED_SCHEMAS))
def test_schema(name):
    needs_extension()
    schema = getattr(torch.ops.ulysses_kernels, name).default._schema
    assert str(schema) == EXPECTED_SCHEMAS[name]


def test_no_other_ops():
    """The functional pack/unpack ops are gone (Python helpers in fused/ops.py now): the
    extension registers exactly the ops above."""
    needs_extension()
    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("ulysses_kernels::") and not n.split("::", 1)[1].startswith("triton_")}
    assert names == set(EXPECTED_SCHEMAS)


def test_mutability_annotations():
    needs_extension()
    ops = torch.ops.ulysses_kernels
    written = {"pack_into": {"send"}, "unpack_into": {"outs"}, "nccl_all_to_all": {"recv"}}
    for name in EXPECTED_SCHEMAS:
        schema = getattr(ops, name).default._schema
        for arg in schema.arguments:
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            assert is_write == (arg.name in written.get(name, ())), (name, arg.name)


# ----------------------------------------------------- NCCL engine host-side errors

def test_cpp_errors_reach_python_in_a_fresh_process():
    """The doctor's probe: a TORCH_CHECK in the extension is a RuntimeError, not a crash
    (the first GPU run's extension, linked by a second GCC, segfaulted here)."""
    needs_extension()
    from ulysses_kernels import extensions

    assert extensions.error_path_problem() is None


def test_communicator_class_and_its_errors():
    """The communicator is a class whose construction checks its arguments in C++ (on any
    machine); without a GPU, a clear exception, not a crash."""
    needs_extension()
    communicator = torch.classes.ulysses_kernels.NcclCommunicator
    schemas = [str(s) for s in torch._C._jit_get_custom_class_schemas() if "ulysses_kernels" in str(s)]
    assert schemas == EXPECTED_CLASS_SCHEMAS
    uid = torch.ops.ulysses_kernels.nccl_unique_id()
    assert uid.shape == (128,) and uid.dtype == torch.uint8 and uid.device.type == "cpu"
    for blocking in (False, True):
        with pytest.raises(RuntimeError, match="unique_id"):
            communicator(torch.zeros(5, dtype=torch.uint8), 1, 0, 0, 1.0, blocking)
        with pytest.raises(RuntimeError, match="bad rank"):
            communicator(uid, 2, 2, 0, 1.0, blocking)
        with pytest.raises(RuntimeError, match="timeout must be positive"):
            communicator(uid, 1, 0, 0, 0.0, blocking)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            communicator(uid, 1, 0, 0, 1.0, False)


@pytest.mark.gpu
def test_communicator_lives_as_long_as_its_object():
    """RAII: a closed communicator, or one whose Python object was dropped, is unknown to
    the all-to-all op (its handle is not open); an unknown handle raises alike."""
    needs_extension(fused_ops=True)
    import gc

    ops = torch.ops.ulysses_kernels
    x = torch.ones(8, device="cuda")
    comm = torch.classes.ulysses_kernels.NcclCommunicator(ops.nccl_unique_id(), 1, 0, torch.cuda.current_device(),
                                                          30.0, False)
    handle = comm.handle()
    assert comm.handle() == handle
    y = torch.zeros_like(x)
    ops.nccl_all_to_all(handle, x, y, [8], [8])
    comm.wait(30.0)
    assert torch.equal(y, x)
    comm.close()
    comm.close()  # idempotent
    with pytest.raises(RuntimeError, match="not open"):
        ops.nccl_all_to_all(handle, x, y, [8], [8])
    dropped = torch.classes.ulysses_kernels.NcclCommunicator(ops.nccl_unique_id(), 1, 0, torch.cuda.current_device(),
                                                             30.0, False)
    handle = dropped.handle()
    del dropped
    gc.collect()
    with pytest.raises(RuntimeError, match="not open"):
        ops.nccl_all_to_all(handle, x, y, [8], [8])
    with pytest.raises(RuntimeError, match="not open"):
        ops.nccl_all_to_all(987654, x, y, [8], [8])


# --------------------- kernel index math on the host (the kernels compiled as C++ code)

_HARNESS = r"""// Host emulation of the pack/unpack kernels' index math (generated by tests/csrc/test_csrc.py).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <vector>
#include <random>
#include <cmath>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "pack_index.h"
using namespace ulysses_kernels;
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __launch_bounds__
#define __launch_bounds__(x)
#undef blockIdx
#undef threadIdx
#undef gridDim
#undef blockDim
struct Idx { unsigned x, y, z; };
static Idx blockIdx, threadIdx, gridDim, blockDim;
@KERNELS@
}  // namespace

// ---------------- reference (float32 data, any element size emulated via ELEM=4)
template <typename F>
void launch(F kernel, int64_t grid_x, int grid_y) {
  gridDim = {(unsigned)grid_x, (unsigned)grid_y, 1};
  for (unsigned by = 0; by < (unsigned)grid_y; ++by)
    for (unsigned bx = 0; bx < grid_x; ++bx)
      for (unsigned t = 0; t < (unsigned)kThreads; ++t) {
        blockIdx = {bx, by, 0}; threadIdx = {t, 0, 0};
        kernel();
      }
}

int64_t grid_for_host(uint64_t total, int64_t cap) {
  const uint64_t per_block = (uint64_t)kThreads * kUnroll;
  int64_t b = (int64_t)((total + per_block - 1) / per_block);
  if (b > cap) b = cap;
  return b < 1 ? 1 : b;
}

int failures = 0;

// One placement case: which heads of each tensor t go where (computed in Python by
// ulysses_kernels.layout.place_heads and written into kCases below; nothing here decides a
// placement) and which chunk of local heads [off, off + cnt) is packed.
struct Case { int P; int H[3]; int local[3]; int rep[3]; int off[3]; int cnt[3]; };
static const Case kCases[] = {
@CASES@
};

// Pack the chunk of each tensor (float data, strides BSHD or head-major) and compare with
// the reference; then unpack the send buffer back (as if it were the receive buffer of
// the backward: replicas summed in fp32, in replica order) and compare.
// WIDE: the 64-bit index variant of the kernels (sends of 2**31 vectors or more), run
// here on the same small cases.
template <int V, bool WIDE>
void run_case(const Case& c, int B, int S, int D, bool transposed, int64_t cap) {
  const int P = c.P, n = 3;
  std::mt19937 rng(P * 1000 + B * 100 + S + D);
  std::uniform_real_distribution<float> U(-1, 1);
  std::vector<std::vector<float>> src(n);
  std::vector<int64_t> sb(n), ss(n), sh(n);
  for (int t = 0; t < n; ++t) {
    src[t].resize((size_t)B * S * c.H[t] * D);
    for (auto& x : src[t]) x = U(rng);
    if (!transposed) { sh[t] = D; ss[t] = (int64_t)c.H[t] * D; sb[t] = (int64_t)S * c.H[t] * D; }
    else { ss[t] = D; sh[t] = (int64_t)S * D; sb[t] = (int64_t)S * c.H[t] * D; }  // [B, H, S, D] memory
  }
  int C = 0; for (int t = 0; t < n; ++t) C += c.cnt[t];
  std::vector<float> send((size_t)P * B * S * C * D, -7.f), ref(send.size(), -7.f);
  PackParams p{}; p.send = (char*)send.data(); p.P = P; p.B = B; p.S = S; p.C = C; p.D = D;
  int chan = 0, nj = 0;
  for (int t = 0; t < n; ++t) {
    if (c.cnt[t] == 0) continue;
    PackJob& j = p.job[nj++];
    j.src = (const char*)src[t].data(); j.sb = sb[t]; j.ss = ss[t]; j.sh = sh[t]; j.sd = 1;
    j.local = c.local[t]; j.rep = c.rep[t]; j.offset = c.off[t]; j.count = c.cnt[t]; j.chan = chan;
    j.rep_div = FastDiv(j.rep);
    // reference: destination jj's chunk head l is source head (jj / rep) * local + off + l
    for (int jj = 0; jj < P; ++jj) for (int b = 0; b < B; ++b) for (int s = 0; s < S; ++s)
      for (int l = 0; l < c.cnt[t]; ++l) for (int d = 0; d < D; ++d) {
        const int head = (jj / c.rep[t]) * c.local[t] + c.off[t] + l;
        ref[((((size_t)jj * B + b) * S + s) * C + chan + l) * D + d] = src[t][b * sb[t] + s * ss[t] + head * sh[t] + d];
      }
    chan += c.cnt[t];
  }
  p.njobs = nj;
  p.dv_count = D / V; p.inner = C * (D / V);
  p.inner_div = FastDiv(p.inner); p.S_div = FastDiv(S); p.B_div = FastDiv(B); p.dv_div = FastDiv(p.dv_count);
  const uint64_t total = (uint64_t)P * B * S * p.inner;
  launch([&] { pack_kernel<4, V, WIDE>(p, total); }, grid_for_host(total, cap), 1);
  if (memcmp(send.data(), ref.data(), send.size() * 4) != 0) {
    ++failures; printf("PACK MISMATCH V=%d P=%d B=%d S=%d D=%d C=%d\n", V, P, B, S, D, C);
  }
  // The same pack with the rotary embedding on q and k (tensors 0 and 1): cos/sin tables
  // [B, S, D], y[d] = x[d] * cos[d] + rotate_half(x)[d] * sin[d].
  {
    std::vector<float> cs((size_t)B * S * D), sn(cs.size()), rsend(send.size(), -7.f), rref(send.size(), -7.f);
    for (auto& x : cs) x = U(rng);
    for (auto& x : sn) x = U(rng);
    PackParams r = p; r.send = (char*)rsend.data(); r.cos = (const char*)cs.data(); r.sin = (const char*)sn.data();
    r.rb = (int64_t)S * D; r.rs = D;
    const int h = D / 2;
    int ch0 = 0, k = 0;
    for (int t = 0; t < n; ++t) {
      if (c.cnt[t] == 0) continue;
      r.job[k++].rotary = t < 2;
      for (int jj = 0; jj < P; ++jj) for (int b = 0; b < B; ++b) for (int s = 0; s < S; ++s)
        for (int l = 0; l < c.cnt[t]; ++l) for (int d = 0; d < D; ++d) {
          const int head = (jj / c.rep[t]) * c.local[t] + c.off[t] + l;
          const float* x = &src[t][b * sb[t] + s * ss[t] + head * sh[t]];
          float y = x[d];
          if (t < 2) {
            const float rot = d < h ? -x[d + h] : x[d - h];
            y = x[d] * cs[((size_t)b * S + s) * D + d] + rot * sn[((size_t)b * S + s) * D + d];
          }
          rref[((((size_t)jj * B + b) * S + s) * C + ch0 + l) * D + d] = y;
        }
      ch0 += c.cnt[t];
    }
    launch([&] { pack_rotary_kernel<float, V, WIDE>(r, total); }, grid_for_host(total, cap), 1);
    for (size_t e = 0; e < rsend.size(); ++e)
      if (std::fabs(rsend[e] - rref[e]) > 1e-5f) {
        ++failures; printf("ROTARY PACK MISMATCH V=%d P=%d B=%d S=%d D=%d at %zu\n", V, P, B, S, D, e); break;
      }
  }
  std::vector<std::vector<float>> out(n), oref(n);
  UnpackParams u{}; u.recv = (const char*)send.data(); u.P = P; u.B = B; u.S = S; u.C = C; u.D = D;
  u.dv_count = D / V; u.S_div = FastDiv(S); u.dv_div = FastDiv(u.dv_count);
  chan = 0; nj = 0; uint64_t max_total = 1;
  for (int t = 0; t < n; ++t) {
    out[t].assign((size_t)B * S * c.H[t] * D, 0.f); oref[t] = out[t];
    if (c.cnt[t] == 0) continue;
    const int rep = c.rep[t], groups = P / rep;
    UnpackJob& j = u.job[nj++];
    j.out = (char*)out[t].data(); j.ob = sb[t]; j.os = ss[t]; j.oh = sh[t]; j.od = 1;
    j.local = c.local[t]; j.rep = rep; j.offset = c.off[t]; j.count = c.cnt[t]; j.chan = chan;
    j.nheads = groups * c.cnt[t];
    j.inner = j.nheads * (D / V); j.inner_div = FastDiv(j.inner); j.count_div = FastDiv(j.count);
    if ((uint64_t)B * S * j.inner > max_total) max_total = (uint64_t)B * S * j.inner;
    // reference: head g * local + off + l is the sum over sources [g * rep, (g + 1) * rep)
    for (int g = 0; g < groups; ++g) for (int l = 0; l < c.cnt[t]; ++l)
      for (int b = 0; b < B; ++b) for (int s = 0; s < S; ++s) for (int d = 0; d < D; ++d) {
        const int head = g * c.local[t] + c.off[t] + l;
        float acc = send[((((size_t)(g * rep) * B + b) * S + s) * C + chan + l) * D + d];
        for (int r = 1; r < rep; ++r) acc += send[((((size_t)(g * rep + r) * B + b) * S + s) * C + chan + l) * D + d];
        oref[t][b * sb[t] + s * ss[t] + head * sh[t] + d] = acc;
      }
    chan += c.cnt[t];
  }
  launch([&] { unpack_kernel<float, V, WIDE>(u); }, grid_for_host(max_total, cap), nj);
  for (int t = 0; t < n; ++t)
    if (memcmp(out[t].data(), oref[t].data(), out[t].size() * 4) != 0) {
      ++failures; printf("UNPACK MISMATCH t=%d V=%d P=%d B=%d S=%d D=%d\n", t, V, P, B, S, D);
    }
}

int main() {
  int cases = 0;
  for (int64_t cap : {3, 1000}) for (bool tr : {false, true})
  for (const Case& c : kCases)
  for (auto BS : std::vector<std::pair<int,int>>{{1, 5}, {2, 3}, {3, 7}}) for (int D : {8, 16, 64, 128, 256}) {
    run_case<1, false>(c, BS.first, BS.second, D, tr, cap);
    run_case<4, false>(c, BS.first, BS.second, D, tr, cap);
    run_case<4, true>(c, BS.first, BS.second, D, tr, cap);
    cases += 3;
  }
  printf("%d cases, %d failures\n", cases, failures);
  return failures != 0;
}
"""


def placement_cases():
    """The placement table of the harness: world sizes 1-8, MHA, GQA split, GQA replicated
    and MQA head counts, each tensor's (local, replicas) from `layout.place_heads`; the
    whole local range and a chunk in the middle of it (query offset 1; KV offset 1, or no
    KV heads in the chunk when there is a single local KV head)."""
    rows = []
    for P in (1, 2, 4, 8):
        for H in ([8, 8, 8], [8, 2, 2], [8, 4, 4], [16, 1, 1]):
            if head_plan_error(P, H[0], H[1]):
                continue
            placements = [place_heads(h, P) for h in H]
            local = [p.local for p in placements]
            rep = [p.replicas for p in placements]
            rows.append((P, H, local, rep, [0, 0, 0], local))
            if local[0] >= 2:
                if local[1] >= 2:
                    rows.append((P, H, local, rep, [1, 1, 1], [n - 1 for n in local]))
                else:
                    rows.append((P, H, local, rep, [1, 0, 0], [local[0] - 1, 0, 0]))
    return rows


def _cpp_table(rows):
    arr = lambda xs: "{" + ", ".join(str(int(x)) for x in xs) + "}"  # noqa: E731
    return ",\n".join(f"  {{{P}, {arr(H)}, {arr(local)}, {arr(rep)}, {arr(off)}, {arr(cnt)}}}"
                      for P, H, local, rep, off, cnt in rows)


def _cuda_include_dirs():
    import glob
    import shutil
    import sys
    dirs = []
    for site in sys.path:
        dirs += glob.glob(os.path.join(site, "nvidia", "cu[0-9]*", "include"))
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    dirs += [os.path.join(h, "include") for h in homes if h]
    return [d for d in dirs if os.path.isdir(d)]


def test_placement_cases_cover_every_kind():
    rows = placement_cases()
    assert {P for P, *_ in rows} == {1, 2, 4, 8}
    assert any(r > 1 for *_, rep, _, _ in rows for r in rep)       # replicated KV heads
    assert any(rep == [1, 1, 1] and H[1] < H[0] for _, H, _, rep, _, _ in rows)  # GQA split
    assert any(c == 0 for *_, cnt in rows for c in cnt)             # a chunk without KV heads
    assert any(o == 1 for *_, off, _ in rows for o in off)          # a chunk in the middle


def test_kernel_index_math_on_host(tmp_path):
    """Compile the bodies of pack_kernel / unpack_kernel as host C++ (g++, __global__ and
    __device__ defined away, blockIdx/threadIdx emulated by loops over a small capped grid
    so the grid-stride loops run) and compare them with a direct reference for the
    placements of `placement_cases` (layout.py's numbers, emitted as a table): all strides
    (BSHD and head-major sources), chunk offsets/counts, split and replicated heads
    (replica sums), scalar (V=1) and 16-byte (V=4 floats) paths, the 32-bit and the 64-bit
    index variants, the pack with the rotary embedding on q and k, P in 1..8, D 8..256."""
    import shutil
    import subprocess
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    inc = _cuda_include_dirs()
    if not any(os.path.exists(os.path.join(d, "cuda_bf16.h")) for d in inc) or \
            not any(os.path.exists(os.path.join(d, "crt", "host_config.h")) for d in inc):
        pytest.skip("CUDA headers not found")
    src = open(os.path.join(ROOT, "csrc", "pack_kernels.cu")).read()
    start = src.index("namespace {")
    stop = src.index("// ------------------------------------------------------------------ host helpers")
    rows = placement_cases()
    text = _HARNESS.replace("@KERNELS@", src[start:stop]).replace("@CASES@", _cpp_table(rows))
    (tmp_path / "harness.cpp").write_text(text)
    exe = tmp_path / "harness"
    csrc = os.path.join(ROOT, "csrc")
    cmd = ([cxx, "-std=c++20", "-O1", "-w", f"-I{csrc}"] + [f"-I{d}" for d in inc]
           + [str(tmp_path / "harness.cpp"), "-o", str(exe)])
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and " 0 failures" in run.stdout, run.stdout[-3000:]
    assert run.stdout.strip().endswith(f"{len(rows) * 2 * 2 * 3 * 5 * 3} cases, 0 failures"), run.stdout[-300:]


def test_pack_index_math_on_host(tmp_path):
    """csrc/pack_index.h built with g++: the multiply-shift division (FastDiv) against `/`
    for divisors 1..1100, powers of two and their neighbours, up to 2**31 - 1, at edge and
    random numerators; the flattened-index decomposition (32-bit and 64-bit) against the
    naive arithmetic for split, chunked, replicated and strided tensors."""
    import shutil
    import subprocess
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    here = os.path.dirname(__file__)
    exe = tmp_path / "pack_index_test"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas",
                            f"-I{os.path.join(ROOT, 'csrc')}", os.path.join(here, "pack_index_test.cpp"),
                            "-o", str(exe)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("pack_index OK"), run.stdout[-2000:]
