// Pack / unpack kernels of the Ulysses exchanges (docs/architecture.md, "Fused path").
//
// The kernels do not decide where a head goes. The caller passes, per tensor t, the
// placement computed by ulysses_kernels/layout.py (docs/architecture.md, "Layout rules"):
// local_heads[t] heads per rank and replicas[t] ranks per head, so that destination j's
// local head l is source head (j / replicas) * local_heads + l (split heads: replicas 1;
// GQA/MQA key/value heads replicated to P / H_t ranks: local_heads 1).
//
// pack_into: tensors t = q, k, v `[B, S_p, H_t, D]` (any strides) -> send buffer
//   `[P, B, S_p, C, D]` (contiguous), channels = the tensors' chunk heads in order: for
//   destination j and chunk head l of tensor t, source head
//   (j / replicas_t) * local_heads_t + offset_t + l.
//   The same kernel packs dO (one tensor) into the seq->heads send layout.
// unpack_into: receive buffer `[P, B, S_p, C, D]` (contiguous) -> tensors
//   `[B, S_p, H_t, D]` (any strides), the inverse map. Heads with one replica are copied
//   bitwise; replicated heads are the fp32-accumulated sum of their replicas (in replica
//   order), which is the backward of the replication done by pack.
//
// Both kernels are one pass, output-driven, with one 16-byte access per thread and
// iteration when every pointer and stride allows it (scalar fallback otherwise).
// Threads of a block cover `rows_per_block` (b, s) rows of `inner` = heads * D / V
// vectors each, so the 64-bit row decomposition is amortised over a row and the
// per-vector index math is 32-bit. All offsets are int64.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace ulysses_kernels {
namespace {

constexpr int kMaxJobs = 3;
constexpr int kThreads = 256;

struct PackJob {
  const char* src;          // base pointer (storage offset applied)
  int64_t sb, ss, sh, sd;   // strides in elements
  int local;                // heads per destination (placement)
  int rep;                  // destinations per head (placement; 1: split)
  int offset;               // first local head of this chunk
  int count;                // heads of this tensor in this chunk (> 0)
  int chan;                 // first channel in the send buffer
};

struct PackParams {
  PackJob job[kMaxJobs];
  int njobs;
  char* send;
  int64_t P, B, S;
  int C, D;
};

struct UnpackJob {
  char* out;
  int64_t ob, os, oh, od;   // strides in elements
  int local, rep, offset, count, chan;  // placement (local, rep) and chunk heads, as PackJob
  int nheads;               // output heads written: (P / rep) * count
};

struct UnpackParams {
  UnpackJob job[kMaxJobs];
  const char* recv;
  int64_t P, B, S;
  int C, D;
};

template <int BYTES>
struct Vec;
template <>
struct Vec<2> { using T = uint16_t; };
template <>
struct Vec<4> { using T = uint32_t; };
template <>
struct Vec<16> { using T = uint4; };

// ELEM: element size in bytes; V: elements per access (1 or 16 / ELEM).
template <int ELEM, int V>
__global__ void __launch_bounds__(kThreads) pack_kernel(const PackParams p) {
  using T = typename Vec<ELEM * V>::T;
  const int dv_count = p.D / V;
  const int inner = p.C * dv_count;
  const int inner_threads = inner < kThreads ? inner : kThreads;
  const int rows_per_block = kThreads / inner_threads;
  const int r_local = threadIdx.x / inner_threads;
  if (r_local >= rows_per_block) return;
  const int i0 = threadIdx.x - r_local * inner_threads;
  const int64_t rows = p.P * p.B * p.S;
  for (int64_t row = (int64_t)blockIdx.x * rows_per_block + r_local; row < rows;
       row += (int64_t)gridDim.x * rows_per_block) {
    const int64_t s = row % p.S;
    const int64_t jb = row / p.S;
    const int64_t b = jb % p.B;
    const int64_t j = jb / p.B;
    T* dst = reinterpret_cast<T*>(p.send) + row * (int64_t)inner;
    for (int i = i0; i < inner; i += inner_threads) {
      const int ch = i / dv_count;
      const int dv = i - ch * dv_count;
      int t = 0;
#pragma unroll
      for (int q = 1; q < kMaxJobs; ++q) {
        if (q < p.njobs && ch >= p.job[q].chan) t = q;
      }
      const PackJob& job = p.job[t];
      const int l = ch - job.chan;
      const int64_t head = (j / job.rep) * job.local + job.offset + l;
      const char* src = job.src + (b * job.sb + s * job.ss + head * job.sh) * ELEM;
      if (V == 1) {
        dst[i] = *reinterpret_cast<const T*>(src + (int64_t)dv * job.sd * ELEM);
      } else {
        dst[i] = reinterpret_cast<const T*>(src)[dv];
      }
    }
  }
}

template <typename S>
__device__ __forceinline__ float to_float(S x) { return static_cast<float>(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename S>
__device__ __forceinline__ S from_float(float x) { return static_cast<S>(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <typename S, int V>
struct alignas(sizeof(S) * V) Pack { S v[V]; };

// S: scalar type (float, __half, __nv_bfloat16); V: elements per access.
template <typename S, int V>
__global__ void __launch_bounds__(kThreads) unpack_kernel(const UnpackParams p) {
  using P = Pack<S, V>;
  const UnpackJob& job = p.job[blockIdx.y];
  const int dv_count = p.D / V;
  const int inner = job.nheads * dv_count;
  const int inner_threads = inner < kThreads ? inner : kThreads;
  const int rows_per_block = kThreads / inner_threads;
  const int r_local = threadIdx.x / inner_threads;
  if (r_local >= rows_per_block) return;
  const int i0 = threadIdx.x - r_local * inner_threads;
  const int64_t rows = p.B * p.S;
  const int64_t slot_stride = p.B * p.S * (int64_t)p.C * p.D;  // elements between source slots
  for (int64_t row = (int64_t)blockIdx.x * rows_per_block + r_local; row < rows;
       row += (int64_t)gridDim.x * rows_per_block) {
    const int64_t s = row % p.S;
    const int64_t b = row / p.S;
    const S* rrow = reinterpret_cast<const S*>(p.recv) + row * (int64_t)p.C * p.D;
    for (int i = i0; i < inner; i += inner_threads) {
      const int hi = i / dv_count;
      const int dv = i - hi * dv_count;
      // Output head hi is chunk head l of replica group g, held by sources [g * rep, (g + 1) * rep).
      const int g = hi / job.count;
      const int l = hi - g * job.count;
      const int64_t head = (int64_t)g * job.local + job.offset + l;
      const S* src = rrow + (int64_t)g * job.rep * slot_stride + (int64_t)(job.chan + l) * p.D + (int64_t)dv * V;
      S* dst = reinterpret_cast<S*>(job.out) + b * job.ob + s * job.os + head * job.oh;
      if (job.rep == 1) {
        if (V == 1) {
          dst[(int64_t)dv * job.od] = *src;
        } else {
          reinterpret_cast<P*>(dst)[dv] = *reinterpret_cast<const P*>(src);
        }
      } else {
        float acc[V];
        const P first = *reinterpret_cast<const P*>(src);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = to_float(first.v[e]);
        for (int r = 1; r < job.rep; ++r) {
          const P x = *reinterpret_cast<const P*>(src + r * slot_stride);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] += to_float(x.v[e]);
        }
        P y;
#pragma unroll
        for (int e = 0; e < V; ++e) y.v[e] = from_float<S>(acc[e]);
        if (V == 1) {
          dst[(int64_t)dv * job.od] = y.v[0];
        } else {
          reinterpret_cast<P*>(dst)[dv] = y;
        }
      }
    }
  }
}

// ------------------------------------------------------------------ host helpers

// Checks that a placement passed by the caller describes `heads` heads over `world` ranks
// (it does not choose one: ulysses_kernels/layout.py does).
void check_placement(int64_t heads, int64_t world, int64_t local, int64_t rep, const char* what, int64_t t) {
  TORCH_CHECK(local >= 1 && rep >= 1 && world % rep == 0 && (world / rep) * local == heads, what, ": tensor ", t,
              " has ", heads, " heads, which local_heads=", local, " and replicas=", rep, " over ", world,
              " ranks do not describe");
}

void check_lists(int64_t n, at::IntArrayRef offsets, at::IntArrayRef counts, at::IntArrayRef local,
                 at::IntArrayRef rep, const char* what) {
  TORCH_CHECK(n >= 1 && n <= kMaxJobs, what, ": 1 to 3 tensors, got ", n);
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == n && static_cast<int64_t>(counts.size()) == n &&
                  static_cast<int64_t>(local.size()) == n && static_cast<int64_t>(rep.size()) == n,
              what, ": offsets, counts, local_heads and replicas need one entry per tensor");
}

void check_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf || t.scalar_type() == at::kFloat,
              what, ": dtype must be bfloat16, float16 or float32, got ", t.scalar_type());
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

int64_t grid_for(int64_t rows, int inner) {
  const int inner_threads = inner < kThreads ? inner : kThreads;
  const int rows_per_block = kThreads / inner_threads;
  int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t cap = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  if (blocks > cap) blocks = cap;
  return blocks < 1 ? 1 : blocks;
}

}  // namespace

void pack_into(at::TensorList srcs, const at::Tensor& send, at::IntArrayRef offsets, at::IntArrayRef counts,
               at::IntArrayRef local_heads, at::IntArrayRef replicas) {
  TORCH_CHECK(send.is_cuda(), "pack_into: send must be a CUDA tensor");
  TORCH_CHECK(send.dim() == 5, "pack_into: send must be [P, B, S, C, D], got ", send.sizes());
  TORCH_CHECK(send.is_contiguous(), "pack_into: send must be contiguous");
  check_dtype(send, "pack_into");
  const int64_t n = static_cast<int64_t>(srcs.size());
  check_lists(n, offsets, counts, local_heads, replicas, "pack_into");
  const int64_t P = send.size(0), B = send.size(1), S = send.size(2), C = send.size(3), D = send.size(4);
  TORCH_CHECK(P >= 1, "pack_into: world must be >= 1");
  c10::cuda::CUDAGuard guard(send.device());
  PackParams p{};
  p.send = static_cast<char*>(send.data_ptr());
  p.P = P; p.B = B; p.S = S; p.C = static_cast<int>(C); p.D = static_cast<int>(D);
  const int elem = static_cast<int>(send.element_size());
  const int V16 = 16 / elem;
  bool vec = (D % V16 == 0) && aligned16(p.send);
  int chan = 0;
  int njobs = 0;
  for (int64_t t = 0; t < n; ++t) {
    const at::Tensor& x = srcs[t];
    TORCH_CHECK(x.dim() == 4, "pack_into: source ", t, " must be [B, S, H, D], got ", x.sizes());
    TORCH_CHECK(x.device() == send.device(), "pack_into: source ", t, " is on ", x.device(), ", send on ", send.device());
    TORCH_CHECK(x.scalar_type() == send.scalar_type(), "pack_into: source ", t, " dtype ", x.scalar_type(),
                " != send dtype ", send.scalar_type());
    TORCH_CHECK(x.size(0) == B && x.size(1) == S && x.size(3) == D, "pack_into: source ", t, " shape ", x.sizes(),
                " does not match send ", send.sizes());
    check_placement(x.size(2), P, local_heads[t], replicas[t], "pack_into", t);
    const int64_t off = offsets[t], cnt = counts[t];
    TORCH_CHECK(off >= 0 && cnt >= 0 && off + cnt <= local_heads[t], "pack_into: source ", t, " offset ", off,
                " + count ", cnt, " exceeds its ", local_heads[t], " heads per destination");
    if (cnt == 0) continue;
    PackJob& job = p.job[njobs++];
    job.src = static_cast<const char*>(x.data_ptr());
    job.sb = x.stride(0); job.ss = x.stride(1); job.sh = x.stride(2); job.sd = x.stride(3);
    job.local = static_cast<int>(local_heads[t]); job.rep = static_cast<int>(replicas[t]);
    job.offset = static_cast<int>(off); job.count = static_cast<int>(cnt); job.chan = chan;
    chan += static_cast<int>(cnt);
    vec = vec && aligned16(job.src) && job.sd == 1 && job.sb % V16 == 0 && job.ss % V16 == 0 && job.sh % V16 == 0;
  }
  TORCH_CHECK(chan == C, "pack_into: counts sum to ", chan, " but send has ", C, " channels");
  p.njobs = njobs;
  const int64_t rows = P * B * S;
  if (rows == 0 || C == 0 || D == 0) return;
  TORCH_CHECK(C * D <= (int64_t)INT32_MAX / 2, "pack_into: C * D too large");
  const int V = vec ? V16 : 1;
  const int64_t grid = grid_for(rows, static_cast<int>(C * (D / V)));
  auto stream = at::cuda::getCurrentCUDAStream();
  if (elem == 2) {
    if (vec) pack_kernel<2, 8><<<grid, kThreads, 0, stream>>>(p);
    else pack_kernel<2, 1><<<grid, kThreads, 0, stream>>>(p);
  } else {
    if (vec) pack_kernel<4, 4><<<grid, kThreads, 0, stream>>>(p);
    else pack_kernel<4, 1><<<grid, kThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void unpack_into(const at::Tensor& recv, at::TensorList outs, at::IntArrayRef offsets, at::IntArrayRef counts,
                 at::IntArrayRef local_heads, at::IntArrayRef replicas) {
  TORCH_CHECK(recv.is_cuda(), "unpack_into: recv must be a CUDA tensor");
  TORCH_CHECK(recv.dim() == 5, "unpack_into: recv must be [P, B, S, C, D], got ", recv.sizes());
  TORCH_CHECK(recv.is_contiguous(), "unpack_into: recv must be contiguous");
  check_dtype(recv, "unpack_into");
  const int64_t n = static_cast<int64_t>(outs.size());
  check_lists(n, offsets, counts, local_heads, replicas, "unpack_into");
  const int64_t P = recv.size(0), B = recv.size(1), S = recv.size(2), C = recv.size(3), D = recv.size(4);
  TORCH_CHECK(P >= 1, "unpack_into: world must be >= 1");
  c10::cuda::CUDAGuard guard(recv.device());
  UnpackParams p{};
  p.recv = static_cast<const char*>(recv.data_ptr());
  p.P = P; p.B = B; p.S = S; p.C = static_cast<int>(C); p.D = static_cast<int>(D);
  const int elem = static_cast<int>(recv.element_size());
  const int V16 = 16 / elem;
  bool vec = (D % V16 == 0) && aligned16(p.recv);
  int chan = 0;
  int njobs = 0;
  for (int64_t t = 0; t < n; ++t) {
    const at::Tensor& x = outs[t];
    TORCH_CHECK(x.dim() == 4, "unpack_into: output ", t, " must be [B, S, H, D], got ", x.sizes());
    TORCH_CHECK(x.device() == recv.device(), "unpack_into: output ", t, " is on ", x.device(), ", recv on ",
                recv.device());
    TORCH_CHECK(x.scalar_type() == recv.scalar_type(), "unpack_into: output ", t, " dtype ", x.scalar_type(),
                " != recv dtype ", recv.scalar_type());
    TORCH_CHECK(x.size(0) == B && x.size(1) == S && x.size(3) == D, "unpack_into: output ", t, " shape ",
                x.sizes(), " does not match recv ", recv.sizes());
    check_placement(x.size(2), P, local_heads[t], replicas[t], "unpack_into", t);
    const int64_t off = offsets[t], cnt = counts[t];
    TORCH_CHECK(off >= 0 && cnt >= 0 && off + cnt <= local_heads[t], "unpack_into: output ", t, " offset ", off,
                " + count ", cnt, " exceeds its ", local_heads[t], " heads per source");
    if (cnt == 0) {
      continue;
    }
    UnpackJob& job = p.job[njobs++];
    job.out = static_cast<char*>(x.data_ptr());
    job.ob = x.stride(0); job.os = x.stride(1); job.oh = x.stride(2); job.od = x.stride(3);
    job.local = static_cast<int>(local_heads[t]); job.rep = static_cast<int>(replicas[t]);
    job.offset = static_cast<int>(off); job.count = static_cast<int>(cnt); job.chan = chan;
    job.nheads = static_cast<int>((P / replicas[t]) * cnt);
    chan += static_cast<int>(cnt);
    vec = vec && aligned16(job.out) && job.od == 1 && job.ob % V16 == 0 && job.os % V16 == 0 && job.oh % V16 == 0;
  }
  TORCH_CHECK(chan == C, "unpack_into: counts sum to ", chan, " but recv has ", C, " channels");
  const int64_t rows = B * S;
  if (njobs == 0 || rows == 0 || D == 0) return;
  TORCH_CHECK(C * D <= (int64_t)INT32_MAX / 2, "unpack_into: C * D too large");
  const int V = vec ? V16 : 1;
  int max_inner = 0;
  for (int t = 0; t < njobs; ++t) {
    const int64_t inner = static_cast<int64_t>(p.job[t].nheads) * (D / V);
    TORCH_CHECK(inner <= (int64_t)INT32_MAX / 2, "unpack_into: heads * D too large");
    max_inner = inner > max_inner ? static_cast<int>(inner) : max_inner;
  }
  // Jobs with fewer vectors per row finish early; fine for <= 3 jobs.
  const dim3 grid(static_cast<unsigned>(grid_for(rows, max_inner < 1 ? 1 : max_inner)), njobs);
  auto stream = at::cuda::getCurrentCUDAStream();
  switch (recv.scalar_type()) {
    case at::kBFloat16:
      if (vec) unpack_kernel<__nv_bfloat16, 8><<<grid, kThreads, 0, stream>>>(p);
      else unpack_kernel<__nv_bfloat16, 1><<<grid, kThreads, 0, stream>>>(p);
      break;
    case at::kHalf:
      if (vec) unpack_kernel<__half, 8><<<grid, kThreads, 0, stream>>>(p);
      else unpack_kernel<__half, 1><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      if (vec) unpack_kernel<float, 4><<<grid, kThreads, 0, stream>>>(p);
      else unpack_kernel<float, 1><<<grid, kThreads, 0, stream>>>(p);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ulysses_kernels

TORCH_LIBRARY_FRAGMENT(ulysses_kernels, m) {
  m.def("pack_into(Tensor[] srcs, Tensor(a!) send, int[] offsets, int[] counts, int[] local_heads, "
        "int[] replicas) -> ()");
  m.def("unpack_into(Tensor recv, Tensor(a!)[] outs, int[] offsets, int[] counts, int[] local_heads, "
        "int[] replicas) -> ()");
}

TORCH_LIBRARY_IMPL(ulysses_kernels, CUDA, m) {
  m.impl("pack_into", &ulysses_kernels::pack_into);
  m.impl("unpack_into", &ulysses_kernels::unpack_into);
}
