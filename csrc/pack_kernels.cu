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

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// The exchange buffer of a pack (send) or an unpack (recv) and the tensors packed into it
// or unpacked from it, as both wrappers check them.
struct Exchange {
  int64_t P, B, S, C, D;
  int V16;   // elements per 16-byte vector
  bool vec;  // every pointer and stride allows 16-byte vectors
};

// The one validation of pack_into and unpack_into (`what`): the buffer `[P, B, S, C, D]`
// (CUDA, contiguous, bf16/fp16/fp32) and, per tensor t `[B, S, H_t, D]` (its `role`: source
// or output), device, dtype, shape, placement and chunk `[offset, offset + count)`. Calls
// `add(t, tensor, chan)` for every tensor with heads in this call, channels consecutive in
// tensor order, and checks that they fill the buffer's C channels.
template <typename AddJob>
Exchange check_exchange(const char* what, const char* buffer_name, const char* role, const at::Tensor& buffer,
                        at::TensorList tensors, at::IntArrayRef offsets, at::IntArrayRef counts,
                        at::IntArrayRef local_heads, at::IntArrayRef replicas, AddJob add) {
  TORCH_CHECK(buffer.is_cuda(), what, ": ", buffer_name, " must be a CUDA tensor");
  TORCH_CHECK(buffer.dim() == 5, what, ": ", buffer_name, " must be [P, B, S, C, D], got ", buffer.sizes());
  TORCH_CHECK(buffer.is_contiguous(), what, ": ", buffer_name, " must be contiguous");
  TORCH_CHECK(buffer.scalar_type() == at::kBFloat16 || buffer.scalar_type() == at::kHalf ||
                  buffer.scalar_type() == at::kFloat,
              what, ": dtype must be bfloat16, float16 or float32, got ", buffer.scalar_type());
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(n >= 1 && n <= kMaxJobs, what, ": 1 to 3 tensors, got ", n);
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == n && static_cast<int64_t>(counts.size()) == n &&
                  static_cast<int64_t>(local_heads.size()) == n && static_cast<int64_t>(replicas.size()) == n,
              what, ": offsets, counts, local_heads and replicas need one entry per tensor");
  Exchange x{buffer.size(0), buffer.size(1), buffer.size(2), buffer.size(3), buffer.size(4),
             static_cast<int>(16 / buffer.element_size()), false};
  TORCH_CHECK(x.P >= 1, what, ": world must be >= 1");
  x.vec = x.D % x.V16 == 0 && aligned16(buffer.data_ptr());
  int64_t chan = 0;
  for (int64_t t = 0; t < n; ++t) {
    const at::Tensor& y = tensors[t];
    TORCH_CHECK(y.dim() == 4, what, ": ", role, " ", t, " must be [B, S, H, D], got ", y.sizes());
    TORCH_CHECK(y.device() == buffer.device(), what, ": ", role, " ", t, " is on ", y.device(), ", ", buffer_name,
                " on ", buffer.device());
    TORCH_CHECK(y.scalar_type() == buffer.scalar_type(), what, ": ", role, " ", t, " dtype ", y.scalar_type(), " != ",
                buffer_name, " dtype ", buffer.scalar_type());
    TORCH_CHECK(y.size(0) == x.B && y.size(1) == x.S && y.size(3) == x.D, what, ": ", role, " ", t, " shape ",
                y.sizes(), " does not match ", buffer_name, " ", buffer.sizes());
    check_placement(y.size(2), x.P, local_heads[t], replicas[t], what, t);
    const int64_t off = offsets[t], cnt = counts[t];
    TORCH_CHECK(off >= 0 && cnt >= 0 && off + cnt <= local_heads[t], what, ": ", role, " ", t, " offset ", off,
                " + count ", cnt, " exceeds its ", local_heads[t], " heads per rank");
    if (cnt == 0) continue;
    add(t, y, static_cast<int>(chan));
    chan += cnt;
    x.vec = x.vec && aligned16(y.data_ptr()) && y.stride(3) == 1 && y.stride(0) % x.V16 == 0 &&
            y.stride(1) % x.V16 == 0 && y.stride(2) % x.V16 == 0;
  }
  TORCH_CHECK(chan == x.C, what, ": counts sum to ", chan, " but ", buffer_name, " has ", x.C, " channels");
  TORCH_CHECK(x.C * x.D <= (int64_t)INT32_MAX / 2, what, ": C * D too large");
  TORCH_CHECK(x.S < INT32_MAX && x.B < INT32_MAX, what, ": B and S must be below 2**31");
  return x;
}

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

// The one launch ladder of every kernel: `launch(S{}, Vec{}, Wide{})` is called with the
// scalar type of `dtype`, its elements per access (16-byte vectors when `vec`, else 1) and
// whether the index math is 64-bit, as compile-time values.
template <typename Launch>
void dispatch(at::ScalarType dtype, bool vec, bool wide, Launch launch) {
  auto by_width = [&](auto scalar, auto vector) {
    if (wide) launch(scalar, vector, std::true_type{});
    else launch(scalar, vector, std::false_type{});
  };
  auto by_vec = [&](auto scalar, auto v16) {
    if (vec) by_width(scalar, v16);
    else by_width(scalar, std::integral_constant<int, 1>{});
  };
  switch (dtype) {
    case at::kBFloat16: by_vec(__nv_bfloat16{}, std::integral_constant<int, 8>{}); break;
    case at::kHalf: by_vec(__half{}, std::integral_constant<int, 8>{}); break;
    default: by_vec(float{}, std::integral_constant<int, 4>{}); break;
  }
}

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

}  // namespace

void pack_into(at::TensorList srcs, const at::Tensor& send, at::IntArrayRef offsets, at::IntArrayRef counts,
               at::IntArrayRef local_heads, at::IntArrayRef replicas, const std::optional<at::Tensor>& cos,
               const std::optional<at::Tensor>& sin, at::IntArrayRef rotary) {
  TORCH_CHECK(rotary.empty() || rotary.size() == srcs.size(), "pack_into: rotary needs one flag per tensor (or none)");
  bool use_rotary = false;
  for (int64_t r : rotary) use_rotary = use_rotary || r != 0;
  PackParams p{};
  const Exchange x = check_exchange(
      "pack_into", "send", "source", send, srcs, offsets, counts, local_heads, replicas,
      [&](int64_t t, const at::Tensor& src, int chan) {
        PackJob& job = p.job[p.njobs++];
        job.src = static_cast<const char*>(src.data_ptr());
        job.sb = src.stride(0); job.ss = src.stride(1); job.sh = src.stride(2); job.sd = src.stride(3);
        job.local = static_cast<int>(local_heads[t]); job.rep = static_cast<int>(replicas[t]);
        job.offset = static_cast<int>(offsets[t]); job.count = static_cast<int>(counts[t]); job.chan = chan;
        job.rotary = rotary.empty() ? 0 : static_cast<int>(rotary[t] != 0);
        job.rep_div = FastDiv(job.rep);
      });
  c10::cuda::CUDAGuard guard(send.device());
  bool vec = x.vec;
  if (use_rotary) {
    vec = check_rotary(send, cos, sin, x.V16) && vec;
    p.cos = static_cast<const char*>(cos->data_ptr());
    p.sin = static_cast<const char*>(sin->data_ptr());
    p.rb = cos->stride(0);
    p.rs = cos->stride(1);
  }
  const int64_t rows = x.P * x.B * x.S;
  if (rows == 0 || x.C == 0 || x.D == 0) return;
  const int V = vec ? x.V16 : 1;
  p.send = static_cast<char*>(send.data_ptr());
  p.P = x.P; p.B = x.B; p.S = x.S; p.C = static_cast<int>(x.C); p.D = static_cast<int>(x.D);
  p.dv_count = static_cast<int>(x.D / V);
  p.inner = static_cast<int>(x.C * (x.D / V));
  // The divisors (the 64-bit variant divides by their `div` plainly). All are below 2**31.
  p.inner_div = FastDiv(p.inner);
  p.S_div = FastDiv(static_cast<uint32_t>(x.S));
  p.B_div = FastDiv(static_cast<uint32_t>(x.B));
  p.dv_div = FastDiv(p.dv_count);
  const uint64_t total = static_cast<uint64_t>(rows) * p.inner;
  const int64_t grid = grid_for(total);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch(send.scalar_type(), vec, total >= kNarrowLimit, [&](auto scalar, auto v, auto wide) {
    using S = decltype(scalar);
    constexpr int kV = decltype(v)::value;
    constexpr bool kWide = decltype(wide)::value;
    if (use_rotary) {
      pack_rotary_kernel<S, kV, kWide><<<grid, kThreads, 0, stream>>>(p, total);
    } else {
      pack_kernel<sizeof(S), kV, kWide><<<grid, kThreads, 0, stream>>>(p, total);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void unpack_into(const at::Tensor& recv, at::TensorList outs, at::IntArrayRef offsets, at::IntArrayRef counts,
                 at::IntArrayRef local_heads, at::IntArrayRef replicas) {
  UnpackParams p{};
  int njobs = 0;
  const Exchange x = check_exchange(
      "unpack_into", "recv", "output", recv, outs, offsets, counts, local_heads, replicas,
      [&](int64_t t, const at::Tensor& out, int chan) {
        UnpackJob& job = p.job[njobs++];
        job.out = static_cast<char*>(out.data_ptr());
        job.ob = out.stride(0); job.os = out.stride(1); job.oh = out.stride(2); job.od = out.stride(3);
        job.local = static_cast<int>(local_heads[t]); job.rep = static_cast<int>(replicas[t]);
        job.offset = static_cast<int>(offsets[t]); job.count = static_cast<int>(counts[t]); job.chan = chan;
      });
  c10::cuda::CUDAGuard guard(recv.device());
  const int64_t rows = x.B * x.S;
  if (njobs == 0 || rows == 0 || x.D == 0) return;
  const int V = x.vec ? x.V16 : 1;
  p.recv = static_cast<const char*>(recv.data_ptr());
  p.P = x.P; p.B = x.B; p.S = x.S; p.C = static_cast<int>(x.C); p.D = static_cast<int>(x.D);
  p.dv_count = static_cast<int>(x.D / V);
  uint64_t max_total = 0;
  for (int t = 0; t < njobs; ++t) {
    UnpackJob& job = p.job[t];
    job.nheads = static_cast<int>((x.P / job.rep) * job.count);
    const int64_t inner = static_cast<int64_t>(job.nheads) * (x.D / V);
    TORCH_CHECK(inner <= (int64_t)INT32_MAX / 2, "unpack_into: heads * D too large");
    job.inner = static_cast<int>(inner);
    // The divisors (the 64-bit variant divides by their `div` plainly). All are below 2**31.
    job.inner_div = FastDiv(job.inner);
    job.count_div = FastDiv(job.count);
    const uint64_t total = static_cast<uint64_t>(rows) * inner;
    max_total = total > max_total ? total : max_total;
  }
  p.S_div = FastDiv(static_cast<uint32_t>(x.S));
  p.dv_div = FastDiv(p.dv_count);
  // One grid row per job; jobs with fewer vectors finish early (<= 3 jobs).
  const dim3 grid(static_cast<unsigned>(grid_for(max_total)), njobs);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch(recv.scalar_type(), x.vec, max_total >= kNarrowLimit, [&](auto scalar, auto v, auto wide) {
    unpack_kernel<decltype(scalar), decltype(v)::value, decltype(wide)::value><<<grid, kThreads, 0, stream>>>(p);
  });
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
