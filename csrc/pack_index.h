// Index math of the pack / unpack kernels (csrc/pack_kernels.cu), host and device.
//
// The kernels walk one flattened index over (row, 16-byte vector) of their output, so no
// thread idles when a row's vector count does not divide the block, and each thread keeps
// several vectors in flight. Decomposing the index costs several divisions per vector;
// below 2**31 vectors they are 32-bit divisions by loop-invariant divisors, done as a
// multiply-high and a shift (FastDiv). Everything here is plain C++ also compiled for the
// host: tests/csrc/test_csrc.py builds it with g++ and checks it against the naive arithmetic
// (tests/csrc/pack_index_test.cpp), since the kernels themselves need a GPU.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define UK_HD __host__ __device__ __forceinline__
#else
#define UK_HD inline
#endif

namespace ulysses_kernels {

constexpr int kMaxJobs = 3;

// n / div for 0 <= n < 2**31 and 1 <= div < 2**31: q = (umulhi(n, magic) + n) >> shift
// (Granlund and Montgomery; the sum stays below 2**32 because n < 2**31). `div` is kept
// for the 64-bit kernel variants, which divide plainly.
struct FastDiv {
  uint32_t div = 1, magic = 0, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t d) : div(d) {
    while (shift < 32 && (uint64_t{1} << shift) < d) ++shift;
    magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  UK_HD uint32_t operator()(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, magic);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * magic) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

struct PackJob {
  const char* src;          // base pointer (storage offset applied)
  int64_t sb, ss, sh, sd;   // strides in elements
  int local;                // heads per destination (placement)
  int rep;                  // destinations per head (placement; 1: split)
  int offset;               // first local head of this chunk
  int count;                // heads of this tensor in this chunk (> 0)
  int chan;                 // first channel in the send buffer
  int rotary;               // 1: apply the rotary embedding (cos/sin of PackParams) while packing
  FastDiv rep_div;          // j / rep
};

struct PackParams {
  PackJob job[kMaxJobs];
  int njobs;
  char* send;
  int64_t P, B, S;
  int C, D;
  int inner;                // vectors per send row: C * D / V
  int dv_count;             // vectors per head: D / V
  FastDiv inner_div, S_div, B_div, dv_div;
  // Rotary embedding (jobs with `rotary`): cos/sin `[B, S, D]`, element (b, s, d) at
  // b * rb + s * rs + d (rb may be 0: one table for the batch), of the sources' dtype.
  const char* cos;
  const char* sin;
  int64_t rb, rs;
};

struct UnpackJob {
  char* out;
  int64_t ob, os, oh, od;   // strides in elements
  int local, rep, offset, count, chan;  // placement (local, rep) and chunk heads, as PackJob
  int nheads;               // output heads written: (P / rep) * count
  int inner;                // vectors per output row: nheads * D / V
  FastDiv inner_div, count_div;
};

struct UnpackParams {
  UnpackJob job[kMaxJobs];
  const char* recv;
  int64_t P, B, S;
  int C, D;
  int dv_count;
  FastDiv S_div, dv_div;
};

// a / d with the index type I of a kernel variant: the multiply-shift for 32-bit indices
// (numerators < 2**31), a plain division for 64-bit ones (sends of 2**31 vectors or more).
UK_HD uint32_t divide(uint32_t n, const FastDiv& d) { return d(n); }
UK_HD uint64_t divide(uint64_t n, const FastDiv& d) { return n / d.div; }

// Where send vector `idx` (row-major over [P, B, S, C, D / V]) comes from: the job, the
// element offset of its first element in that job's source, its token and first dim.
struct PackSource {
  int job;
  int64_t elem;
  int64_t b, s;             // the token (for the rotary tables)
  int d;                    // the vector's first dim
};

template <typename I>
UK_HD PackSource pack_source(const PackParams& p, I idx, int V) {
  const I row = divide(idx, p.inner_div);
  const I i = idx - row * static_cast<I>(p.inner);
  const I jb = divide(row, p.S_div);
  const I s = row - jb * static_cast<I>(p.S);
  const I j = divide(jb, p.B_div);
  const I b = jb - j * static_cast<I>(p.B);
  const int ch = static_cast<int>(divide(i, p.dv_div));
  const int dv = static_cast<int>(i - static_cast<I>(ch) * static_cast<I>(p.dv_count));
  int t = 0;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int q = 1; q < kMaxJobs; ++q) {
    if (q < p.njobs && ch >= p.job[q].chan) t = q;
  }
  const PackJob& job = p.job[t];
  const int64_t head = static_cast<int64_t>(divide(j, job.rep_div)) * job.local + job.offset + (ch - job.chan);
  const int64_t b64 = static_cast<int64_t>(b), s64 = static_cast<int64_t>(s);
  return {t, b64 * job.sb + s64 * job.ss + head * job.sh + static_cast<int64_t>(dv) * V * job.sd, b64, s64, dv * V};
}

// Output vector `idx` of unpack job `job` (row-major over [B, S, nheads, D / V]): the element
// offset of its first element in the output, and of the first replica's first element in
// the receive buffer (the other replicas follow at multiples of slot_stride).
struct UnpackPlace {
  int64_t out_elem;
  int64_t recv_elem;
};

template <typename I>
UK_HD UnpackPlace unpack_place(const UnpackParams& p, const UnpackJob& job, I idx, int V) {
  const I row = divide(idx, job.inner_div);
  const I i = idx - row * static_cast<I>(job.inner);
  const I b = divide(row, p.S_div);
  const I s = row - b * static_cast<I>(p.S);
  const I hi = divide(i, p.dv_div);
  const int dv = static_cast<int>(i - hi * static_cast<I>(p.dv_count));
  // Output head hi is chunk head l of replica group g, held by sources [g * rep, (g + 1) * rep).
  const I g = divide(hi, job.count_div);
  const int l = static_cast<int>(hi - g * static_cast<I>(job.count));
  const int64_t head = static_cast<int64_t>(g) * job.local + job.offset + l;
  const int64_t slot_stride = p.B * p.S * static_cast<int64_t>(p.C) * p.D;
  return {static_cast<int64_t>(b) * job.ob + static_cast<int64_t>(s) * job.os + head * job.oh +
              static_cast<int64_t>(dv) * V * job.od,
          static_cast<int64_t>(row) * p.C * p.D + static_cast<int64_t>(g) * job.rep * slot_stride +
              static_cast<int64_t>(job.chan + l) * p.D + static_cast<int64_t>(dv) * V};
}

}  // namespace ulysses_kernels
