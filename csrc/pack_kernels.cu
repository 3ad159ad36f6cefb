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
// Both kernels are one pass, output-driven, with one 16-byte access per vector when every
// pointer and stride allows it (scalar fallback otherwise). One flattened index runs over
// (row, vector) of the output, so no thread idles when a row's vector count does not
// divide the block; each thread has kUnroll vectors in flight (loads first, then stores).
// The index decomposition is 32-bit with multiply-shift divisions below 2**31 vectors
// (csrc/pack_index.h, host-tested), 64-bit beyond. Element offsets are int64.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "pack_index.h"

namespace ulysses_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // vectors in flight per thread

template <int BYTES>
struct Vec;
template <>
struct Vec<2> { using T = uint16_t; };
template <>
struct Vec<4> { using T = uint32_t; };
template <>
struct Vec<16> { using T = uint4; };

// The index type of a kernel variant: 32-bit below 2**31 vectors (WIDE false), else 64-bit.
template <bool WIDE>
using Index = std::conditional_t<WIDE, uint64_t, uint32_t>;

// The grid-stride loop of the pack kernels over the send buffer's vectors: each thread
// loads kUnroll vectors (`load(idx)`) before it stores them to dst[idx], so several loads
// are in flight; consecutive threads take consecutive vectors (coalesced stores).
template <bool WIDE, typename T, typename Load>
__device__ __forceinline__ void pack_vectors(T* dst, uint64_t total, Load load) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * kThreads * kUnroll;
  for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < total;
       base += step) {
    T vals[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t idx = base + static_cast<uint64_t>(u) * kThreads;
      if (idx < total) vals[u] = load(static_cast<Index<WIDE>>(idx));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t idx = base + static_cast<uint64_t>(u) * kThreads;
      if (idx < total) dst[idx] = vals[u];
    }
  }
}

// ELEM: element size in bytes; V: elements per access (1 or 16 / ELEM); WIDE: 2**31
// vectors or more (64-bit index math).
template <int ELEM, int V, bool WIDE>
__global__ void __launch_bounds__(kThreads) pack_kernel(const PackParams p, const uint64_t total) {
  using T = typename Vec<ELEM * V>::T;
  pack_vectors<WIDE>(reinterpret_cast<T*>(p.send), total, [&](Index<WIDE> idx) {
    const PackSource src = pack_source(p, idx, V);
    return *reinterpret_cast<const T*>(p.job[src.job].src + src.elem * ELEM);
  });
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

// The pack with the rotary embedding (Hugging Face/Llama rotate-half convention,
// ulysses_kernels/rotary.py) applied to the jobs marked `rotary` (q and k): y = x * cos +
// rotate_half(x) * sin, rotate_half(x)[d] = -x[d + D/2] (d < D/2), x[d - D/2] (else),
// computed in fp32 and rounded once. Other jobs are copied as by pack_kernel. S: scalar
// type; V: elements per access (the vector path needs D/2 % V == 0); WIDE as pack_kernel.
template <typename S, int V, bool WIDE>
__global__ void __launch_bounds__(kThreads) pack_rotary_kernel(const PackParams p, const uint64_t total) {
  using P = Pack<S, V>;
  const int half = p.D / 2;
  pack_vectors<WIDE>(reinterpret_cast<P*>(p.send), total, [&](Index<WIDE> idx) {
    const PackSource src = pack_source(p, idx, V);
    const PackJob& job = p.job[src.job];
    const S* x = reinterpret_cast<const S*>(job.src) + src.elem;
    const P xv = V == 1 ? P{{*x}} : *reinterpret_cast<const P*>(x);
    if (!job.rotary) return xv;
    const bool first = src.d < half;
    const S* partner = x + (first ? half : -half) * job.sd;
    const P pv = V == 1 ? P{{*partner}} : *reinterpret_cast<const P*>(partner);
    const int64_t t = src.b * p.rb + src.s * p.rs + src.d;
    const P c = *reinterpret_cast<const P*>(reinterpret_cast<const S*>(p.cos) + t);
    const P sn = *reinterpret_cast<const P*>(reinterpret_cast<const S*>(p.sin) + t);
    P y;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float rot = first ? -to_float(pv.v[e]) : to_float(pv.v[e]);
      y.v[e] = from_float<S>(to_float(xv.v[e]) * to_float(c.v[e]) + rot * to_float(sn.v[e]));
    }
    return y;
  });
}

template <typename S, int V>
__device__ __forceinline__ Pack<S, V> sum_replicas(const S* src, int rep, int64_t slot_stride) {
  using P = Pack<S, V>;
  float acc[V];
  const P first = *reinterpret_cast<const P*>(src);
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = to_float(first.v[e]);
  for (int r = 1; r < rep; ++r) {
    const P x = *reinterpret_cast<const P*>(src + r * slot_stride);
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] += to_float(x.v[e]);
  }
  P y;
#pragma unroll
  for (int e = 0; e < V; ++e) y.v[e] = from_float<S>(acc[e]);
  return y;
}

// S: scalar type (float, __half, __nv_bfloat16); V: elements per access; WIDE as pack.
// blockIdx.y: the job (output tensor).
template <typename S, int V, bool WIDE>
__global__ void __launch_bounds__(kThreads) unpack_kernel(const UnpackParams p) {
  using P = Pack<S, V>;
  const UnpackJob& job = p.job[blockIdx.y];
  const uint64_t total = static_cast<uint64_t>(p.B * p.S) * job.inner;
  const int64_t slot_stride = p.B * p.S * static_cast<int64_t>(p.C) * p.D;  // elements between source slots
  const S* recv = reinterpret_cast<const S*>(p.recv);
  S* out = reinterpret_cast<S*>(job.out);
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * kThreads * kUnroll;
  for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < total;
       base += step) {
    P vals[kUnroll];
    int64_t dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t idx = base + static_cast<uint64_t>(u) * kThreads;
      if (idx < total) {
        const UnpackPlace at = unpack_place(p, job, static_cast<Index<WIDE>>(idx), V);
        dst[u] = at.out_elem;
        // Replicated heads: the fp32 sum of their replicas, in replica order (the backward
        // of pack's replication); single heads are copied bitwise.
        vals[u] = job.rep == 1 ? *reinterpret_cast<const P*>(recv + at.recv_elem)
                               : sum_replicas<S, V>(recv + at.recv_elem, job.rep, slot_stride);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t idx = base + static_cast<uint64_t>(u) * kThreads;
      if (idx < total) {
        if (V == 1) {
          out[dst[u]] = vals[u].v[0];
        } else {
          *reinterpret_cast<P*>(out + dst[u]) = vals[u];
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

// Blocks of kThreads * kUnroll vectors, at most 32 per SM (the kernels stride over the rest).
int64_t grid_for(uint64_t total) {
  const uint64_t per_block = static_cast<uint64_t>(kThreads) * kUnroll;
  uint64_t blocks = (total + per_block - 1) / per_block;
  const uint64_t cap = static_cast<uint64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  if (blocks > cap) blocks = cap;
  return blocks < 1 ? 1 : static_cast<int64_t>(blocks);
}

// Below this many vectors the index math is 32-bit (FastDiv needs numerators < 2**31).
constexpr uint64_t kNarrowLimit = uint64_t{1} << 31;

// The rotary tables of a pack call: cos/sin `[B, S, D]` (expanded views allowed, last dim
// contiguous) in send's dtype on its device. Returns whether they allow 16-byte vectors.
bool check_rotary(const at::Tensor& send, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                  int V16) {
  TORCH_CHECK(cos.has_value() && sin.has_value(), "pack_into: rotary jobs need cos and sin");
  const int64_t B = send.size(1), S = send.size(2), D = send.size(4);
  TORCH_CHECK(D % 2 == 0, "pack_into: the rotary embedding needs an even head dim, got ", D);
  for (const at::Tensor* t : {&*cos, &*sin}) {
    TORCH_CHECK(t->device() == send.device() && t->scalar_type() == send.scalar_type(),
                "pack_into: cos/sin must be ", send.scalar_type(), " on ", send.device(), ", got ", t->scalar_type(),
                " on ", t->device());
    TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == S && t->size(2) == D && t->stride(2) == 1,
                "pack_into: cos/sin must be [", B, ", ", S, ", ", D, "] with a contiguous last dim, got ", t->sizes(),
                " strides ", t->strides());
  }
  TORCH_CHECK(cos->stride(0) == sin->stride(0) && cos->stride(1) == sin->stride(1),
              "pack_into: cos and sin must have the same strides");
  return (D / 2) % V16 == 0 && aligned16(cos->data_ptr()) && aligned16(sin->data_ptr()) &&
         cos->stride(0) % V16 == 0 && cos->stride(1) % V16 == 0;
}

template <typename S, int V>
void launch_pack_rotary(const PackParams& p, uint64_t total, bool wide, int64_t grid, cudaStream_t stream) {
  if (wide) pack_rotary_kernel<S, V, true><<<grid, kThreads, 0, stream>>>(p, total);
  else pack_rotary_kernel<S, V, false><<<grid, kThreads, 0, stream>>>(p, total);
}

}  // namespace

void pack_into(at::TensorList srcs, const at::Tensor& send, at::IntArrayRef offsets, at::IntArrayRef counts,
               at::IntArrayRef local_heads, at::IntArrayRef replicas, const std::optional<at::Tensor>& cos,
               const std::optional<at::Tensor>& sin, at::IntArrayRef rotary) {
  TORCH_CHECK(send.is_cuda(), "pack_into: send must be a CUDA tensor");
  TORCH_CHECK(send.dim() == 5, "pack_into: send must be [P, B, S, C, D], got ", send.sizes());
  TORCH_CHECK(send.is_contiguous(), "pack_into: send must be contiguous");
  check_dtype(send, "pack_into");
  const int64_t n = static_cast<int64_t>(srcs.size());
  check_lists(n, offsets, counts, local_heads, replicas, "pack_into");
  const int64_t P = send.size(0), B = send.size(1), S = send.size(2), C = send.size(3), D = send.size(4);
  TORCH_CHECK(P >= 1, "pack_into: world must be >= 1");
  TORCH_CHECK(rotary.empty() || static_cast<int64_t>(rotary.size()) == n,
              "pack_into: rotary needs one flag per tensor (or none)");
  bool use_rotary = false;
  for (int64_t r : rotary) use_rotary = use_rotary || r != 0;
  c10::cuda::CUDAGuard guard(send.device());
  PackParams p{};
  p.send = static_cast<char*>(send.data_ptr());
  p.P = P; p.B = B; p.S = S; p.C = static_cast<int>(C); p.D = static_cast<int>(D);
  const int elem = static_cast<int>(send.element_size());
  const int V16 = 16 / elem;
  bool vec = (D % V16 == 0) && aligned16(p.send);
  if (use_rotary) {
    vec = check_rotary(send, cos, sin, V16) && vec;
    p.cos = static_cast<const char*>(cos->data_ptr());
    p.sin = static_cast<const char*>(sin->data_ptr());
    p.rb = cos->stride(0);
    p.rs = cos->stride(1);
  }
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
    job.rotary = rotary.empty() ? 0 : static_cast<int>(rotary[t] != 0);
    chan += static_cast<int>(cnt);
    vec = vec && aligned16(job.src) && job.sd == 1 && job.sb % V16 == 0 && job.ss % V16 == 0 && job.sh % V16 == 0;
  }
  TORCH_CHECK(chan == C, "pack_into: counts sum to ", chan, " but send has ", C, " channels");
  p.njobs = njobs;
  const int64_t rows = P * B * S;
  if (rows == 0 || C == 0 || D == 0) return;
  TORCH_CHECK(C * D <= (int64_t)INT32_MAX / 2, "pack_into: C * D too large");
  const int V = vec ? V16 : 1;
  p.dv_count = static_cast<int>(D / V);
  p.inner = static_cast<int>(C * (D / V));
  const uint64_t total = static_cast<uint64_t>(rows) * p.inner;
  const bool wide = total >= kNarrowLimit;
  // The divisors (the 64-bit variant divides by their `div` plainly). All are below 2**31.
  TORCH_CHECK(S < INT32_MAX && B < INT32_MAX, "pack_into: B and S must be below 2**31");
  p.inner_div = FastDiv(p.inner);
  p.S_div = FastDiv(static_cast<uint32_t>(S));
  p.B_div = FastDiv(static_cast<uint32_t>(B));
  p.dv_div = FastDiv(p.dv_count);
  for (int t = 0; t < njobs; ++t) p.job[t].rep_div = FastDiv(p.job[t].rep);
  const int64_t grid = grid_for(total);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (use_rotary) {
    switch (send.scalar_type()) {
      case at::kBFloat16:
        if (vec) launch_pack_rotary<__nv_bfloat16, 8>(p, total, wide, grid, stream);
        else launch_pack_rotary<__nv_bfloat16, 1>(p, total, wide, grid, stream);
        break;
      case at::kHalf:
        if (vec) launch_pack_rotary<__half, 8>(p, total, wide, grid, stream);
        else launch_pack_rotary<__half, 1>(p, total, wide, grid, stream);
        break;
      default:
        if (vec) launch_pack_rotary<float, 4>(p, total, wide, grid, stream);
        else launch_pack_rotary<float, 1>(p, total, wide, grid, stream);
        break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (elem == 2) {
    if (vec) {
      if (wide) pack_kernel<2, 8, true><<<grid, kThreads, 0, stream>>>(p, total);
      else pack_kernel<2, 8, false><<<grid, kThreads, 0, stream>>>(p, total);
    } else {
      if (wide) pack_kernel<2, 1, true><<<grid, kThreads, 0, stream>>>(p, total);
      else pack_kernel<2, 1, false><<<grid, kThreads, 0, stream>>>(p, total);
    }
  } else {
    if (vec) {
      if (wide) pack_kernel<4, 4, true><<<grid, kThreads, 0, stream>>>(p, total);
      else pack_kernel<4, 4, false><<<grid, kThreads, 0, stream>>>(p, total);
    } else {
      if (wide) pack_kernel<4, 1, true><<<grid, kThreads, 0, stream>>>(p, total);
      else pack_kernel<4, 1, false><<<grid, kThreads, 0, stream>>>(p, total);
    }
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
  p.dv_count = static_cast<int>(D / V);
  uint64_t max_total = 0;
  for (int t = 0; t < njobs; ++t) {
    const int64_t inner = static_cast<int64_t>(p.job[t].nheads) * (D / V);
    TORCH_CHECK(inner <= (int64_t)INT32_MAX / 2, "unpack_into: heads * D too large");
    p.job[t].inner = static_cast<int>(inner);
    const uint64_t total = static_cast<uint64_t>(rows) * inner;
    max_total = total > max_total ? total : max_total;
  }
  const bool wide = max_total >= kNarrowLimit;
  // The divisors (the 64-bit variant divides by their `div` plainly). All are below 2**31.
  TORCH_CHECK(S < INT32_MAX, "unpack_into: S must be below 2**31");
  p.S_div = FastDiv(static_cast<uint32_t>(S));
  p.dv_div = FastDiv(p.dv_count);
  for (int t = 0; t < njobs; ++t) {
    p.job[t].inner_div = FastDiv(p.job[t].inner);
    p.job[t].count_div = FastDiv(p.job[t].count);
  }
  // One grid row per job; jobs with fewer vectors finish early (<= 3 jobs).
  const dim3 grid(static_cast<unsigned>(grid_for(max_total)), njobs);
  auto stream = at::cuda::getCurrentCUDAStream();
#define UK_UNPACK(S, VEC)                                                              \
  if (wide) unpack_kernel<S, VEC, true><<<grid, kThreads, 0, stream>>>(p);             \
  else unpack_kernel<S, VEC, false><<<grid, kThreads, 0, stream>>>(p);
  switch (recv.scalar_type()) {
    case at::kBFloat16:
      if (vec) { UK_UNPACK(__nv_bfloat16, 8) } else { UK_UNPACK(__nv_bfloat16, 1) }
      break;
    case at::kHalf:
      if (vec) { UK_UNPACK(__half, 8) } else { UK_UNPACK(__half, 1) }
      break;
    default:
      if (vec) { UK_UNPACK(float, 4) } else { UK_UNPACK(float, 1) }
      break;
  }
#undef UK_UNPACK
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ulysses_kernels

TORCH_LIBRARY_FRAGMENT(ulysses_kernels, m) {
  m.def("pack_into(Tensor[] srcs, Tensor(a!) send, int[] offsets, int[] counts, int[] local_heads, "
        "int[] replicas, Tensor? cos=None, Tensor? sin=None, int[] rotary=[]) -> ()");
  m.def("unpack_into(Tensor recv, Tensor(a!)[] outs, int[] offsets, int[] counts, int[] local_heads, "
        "int[] replicas) -> ()");
}

TORCH_LIBRARY_IMPL(ulysses_kernels, CUDA, m) {
  m.impl("pack_into", &ulysses_kernels::pack_into);
  m.impl("unpack_into", &ulysses_kernels::unpack_into);
}
