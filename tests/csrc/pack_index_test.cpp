// Host test of csrc/pack_index.h (built and run by tests/csrc/test_csrc.py with g++): the
// multiply-shift divisions and the flattened-index decomposition of the pack / unpack
// kernels against the naive arithmetic the kernels used before (one row per thread group,
// plain divisions). Exits 0 and prints "pack_index OK <checks>" when everything matches.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "pack_index.h"

using namespace ulysses_kernels;

static long long checks = 0;

#define EXPECT(cond, ...)                  \
  do {                                     \
    ++checks;                              \
    if (!(cond)) {                         \
      std::printf("FAIL %s:%d ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);            \
      std::printf("\n");                   \
      std::exit(1);                        \
    }                                      \
  } while (0)

static void test_fast_div() {
  std::mt19937_64 rng(1);
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 1100; ++d) divisors.push_back(d);
  for (uint32_t d : {4095u, 4096u, 4097u, 65535u, 65536u, 65537u, 1000003u, (1u << 30) - 1, 1u << 30,
                     (1u << 30) + 1, (1u << 31) - 1}) divisors.push_back(d);
  for (int i = 0; i < 200; ++i) divisors.push_back(1 + static_cast<uint32_t>(rng() % ((1u << 31) - 1)));
  for (uint32_t d : divisors) {
    const FastDiv f(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 2 * d - 1, (1u << 31) - 1, (1u << 31) - 2, (1u << 30)};
    for (uint32_t k : {3u, 7u, 1000u, 123457u}) {
      const uint64_t m = static_cast<uint64_t>(d) * k;
      if (m < (1u << 31)) { ns.push_back(static_cast<uint32_t>(m)); ns.push_back(static_cast<uint32_t>(m - 1)); }
    }
    for (int i = 0; i < 300; ++i) ns.push_back(static_cast<uint32_t>(rng() % (1u << 31)));
    for (uint32_t n : ns) {
      if (n >= (1u << 31)) continue;
      EXPECT(f(n) == n / d, "FastDiv(%u)(%u) = %u, want %u", d, n, f(n), n / d);
    }
  }
}

struct Tensor { int heads, local, rep, offset, count; int64_t sb, ss, sh, sd; };

// One pack call: P ranks, [B, S] rows, tensors (placements and chunk heads), V elements
// per vector. The source pointers are null: only offsets are compared.
static void check_pack(int P, int B, int S, int D, int V, const std::vector<Tensor>& ts) {
  PackParams p{};
  p.P = P; p.B = B; p.S = S; p.D = D;
  int chan = 0;
  for (size_t t = 0; t < ts.size(); ++t) {
    PackJob& j = p.job[t];
    j.src = nullptr;
    j.sb = ts[t].sb; j.ss = ts[t].ss; j.sh = ts[t].sh; j.sd = ts[t].sd;
    j.local = ts[t].local; j.rep = ts[t].rep; j.offset = ts[t].offset; j.count = ts[t].count; j.chan = chan;
    j.rep_div = FastDiv(j.rep);
    chan += ts[t].count;
  }
  p.njobs = static_cast<int>(ts.size());
  p.C = chan;
  p.dv_count = D / V;
  p.inner = p.C * p.dv_count;
  p.inner_div = FastDiv(p.inner); p.S_div = FastDiv(S); p.B_div = FastDiv(B); p.dv_div = FastDiv(p.dv_count);
  const uint64_t total = static_cast<uint64_t>(P) * B * S * p.inner;
  for (uint64_t idx = 0; idx < total; ++idx) {
    // The naive decomposition: row (j, b, s), channel, vector; the job owning the channel.
    const int64_t row = idx / p.inner, i = idx % p.inner;
    const int64_t s = row % S, b = (row / S) % B, j = row / S / B;
    const int ch = static_cast<int>(i / p.dv_count), dv = static_cast<int>(i % p.dv_count);
    int t = 0;
    while (t + 1 < p.njobs && ch >= p.job[t + 1].chan) ++t;
    const PackJob& job = p.job[t];
    const int64_t head = (j / job.rep) * job.local + job.offset + (ch - job.chan);
    const int64_t want = b * job.sb + s * job.ss + head * job.sh + static_cast<int64_t>(dv) * V * job.sd;
    const PackSource got = pack_source(p, static_cast<uint32_t>(idx), V);
    const PackSource wide = pack_source(p, idx, V);  // the 64-bit variant
    EXPECT(got.job == t && got.elem == want, "pack P=%d B=%d S=%d idx=%llu: job %d elem %lld, want %d %lld", P, B, S,
           static_cast<unsigned long long>(idx), got.job, static_cast<long long>(got.elem), t,
           static_cast<long long>(want));
    EXPECT(wide.job == t && wide.elem == want, "pack wide idx=%llu", static_cast<unsigned long long>(idx));
    EXPECT(got.b == b && got.s == s && got.d == dv * V && wide.b == b && wide.s == s && wide.d == dv * V,
           "pack token idx=%llu", static_cast<unsigned long long>(idx));
  }
}

static void check_unpack(int P, int B, int S, int D, int V, const std::vector<Tensor>& ts) {
  UnpackParams p{};
  p.P = P; p.B = B; p.S = S; p.D = D;
  int chan = 0;
  for (size_t t = 0; t < ts.size(); ++t) {
    UnpackJob& j = p.job[t];
    j.out = nullptr;
    j.ob = ts[t].sb; j.os = ts[t].ss; j.oh = ts[t].sh; j.od = ts[t].sd;
    j.local = ts[t].local; j.rep = ts[t].rep; j.offset = ts[t].offset; j.count = ts[t].count; j.chan = chan;
    j.nheads = (P / j.rep) * j.count;
    chan += ts[t].count;
  }
  p.C = chan;
  p.dv_count = D / V;
  p.S_div = FastDiv(S); p.dv_div = FastDiv(p.dv_count);
  const int64_t slot_stride = static_cast<int64_t>(B) * S * p.C * D;
  for (size_t t = 0; t < ts.size(); ++t) {
    UnpackJob& job = p.job[t];
    job.inner = job.nheads * p.dv_count;
    job.inner_div = FastDiv(job.inner); job.count_div = FastDiv(job.count);
    const uint64_t total = static_cast<uint64_t>(B) * S * job.inner;
    for (uint64_t idx = 0; idx < total; ++idx) {
      const int64_t row = idx / job.inner, i = idx % job.inner;
      const int64_t s = row % S, b = row / S;
      const int hi = static_cast<int>(i / p.dv_count), dv = static_cast<int>(i % p.dv_count);
      const int g = hi / job.count, l = hi % job.count;
      const int64_t head = static_cast<int64_t>(g) * job.local + job.offset + l;
      const int64_t out = b * job.ob + s * job.os + head * job.oh + static_cast<int64_t>(dv) * V * job.od;
      const int64_t recv = row * p.C * D + static_cast<int64_t>(g) * job.rep * slot_stride +
                           static_cast<int64_t>(job.chan + l) * D + static_cast<int64_t>(dv) * V;
      const UnpackPlace got = unpack_place(p, job, static_cast<uint32_t>(idx), V);
      const UnpackPlace wide = unpack_place(p, job, idx, V);  // the 64-bit variant
      EXPECT(got.out_elem == out && got.recv_elem == recv, "unpack P=%d B=%d S=%d job %zu idx=%llu", P, B, S, t,
             static_cast<unsigned long long>(idx));
      EXPECT(wide.out_elem == out && wide.recv_elem == recv, "unpack wide idx=%llu",
             static_cast<unsigned long long>(idx));
    }
  }
}

// Contiguous [B, S, H, D] strides.
static Tensor dense(int B, int S, int H, int D, int local, int rep, int offset, int count) {
  (void)B;
  return {H, local, rep, offset, count, static_cast<int64_t>(S) * H * D, static_cast<int64_t>(H) * D, D, 1};
}

int main() {
  test_fast_div();
  // q/k/v with split heads, GQA and replicated KV heads (MQA), chunks, odd lengths, both V.
  for (int V : {1, 8}) {
    const int D = 16;
    // P = 4: q 8 heads split (local 2), k/v 2 heads replicated x2 (local 1, rep 2).
    check_pack(4, 2, 5, D, V, {dense(2, 5, 8, D, 2, 1, 0, 2), dense(2, 5, 2, D, 1, 2, 0, 1),
                               dense(2, 5, 2, D, 1, 2, 0, 1)});
    check_unpack(4, 2, 5, D, V, {dense(2, 5, 8, D, 2, 1, 0, 2), dense(2, 5, 2, D, 1, 2, 0, 1),
                                 dense(2, 5, 2, D, 1, 2, 0, 1)});
    // P = 3, chunk 1 of 2 of q's 2 local heads (offset 1), MQA k/v (rep 3).
    check_pack(3, 1, 7, D, V, {dense(1, 7, 6, D, 2, 1, 1, 1), dense(1, 7, 1, D, 1, 3, 0, 1),
                               dense(1, 7, 1, D, 1, 3, 0, 1)});
    check_unpack(3, 1, 7, D, V, {dense(1, 7, 6, D, 2, 1, 1, 1), dense(1, 7, 1, D, 1, 3, 0, 1),
                                 dense(1, 7, 1, D, 1, 3, 0, 1)});
    // One tensor (dO), P = 1; and a strided source (a head slice of a packed qkv tensor).
    check_pack(1, 3, 4, D, V, {dense(3, 4, 4, D, 4, 1, 0, 4)});
    Tensor sliced = {3, 1, 1, 0, 1, 4 * 12 * D, 12 * D, D, 1};
    check_pack(3, 2, 4, D, V, {sliced});
    check_unpack(3, 2, 4, D, V, {sliced});
  }
  // Non-unit dim stride (scalar path only).
  Tensor dstride = {2, 1, 1, 0, 1, 5 * 2 * 32, 2 * 32, 32, 2};
  check_pack(2, 2, 5, 16, 1, {dstride});
  check_unpack(2, 2, 5, 16, 1, {dstride});
  std::printf("pack_index OK %lld\n", checks);
  return 0;
}
