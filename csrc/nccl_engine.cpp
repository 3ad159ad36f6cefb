// NCCL communicator engine for the fused Ulysses path.
//
// One communicator per sequence-parallel group (Python keeps the handle, the comm
// stream, the reusable buffers and the events: ulysses_kernels/fused/engine.py). The
// communicator is created in NCCL's non-blocking mode so every wait is a poll of
// ncclCommGetAsyncError with a timeout: a peer that never arrives, or an NCCL error,
// becomes a Python exception (after ncclCommAbort) instead of a hang.
//
// Ops (torch.ops.ulysses_kernels):
//   nccl_unique_id() -> Tensor                      128 uint8 bytes, CPU (rank 0 makes it)
//   nccl_comm_create(Tensor unique_id, int world, int rank, int device, float timeout_s, bool blocking) -> int
//   nccl_comm_destroy(int comm) -> ()
//   nccl_all_to_all(int comm, Tensor send, Tensor(a!) recv, int[] send_counts, int[] recv_counts) -> ()
//       grouped ncclSend/ncclRecv on the *current* CUDA stream (the caller makes its comm
//       stream current); counts are elements per peer, offsets their prefix sums.
//       No host synchronisation, so it can be captured in a CUDA graph.
//   nccl_comm_wait(int comm, float timeout_s) -> ()
//       host wait (with timeout) for the work queued so far on the current stream;
//       raises if NCCL reported an error or the timeout expires. Not for graph capture.
//
// Non-blocking mode and NCCL >= 2.19: every ncclGroupEnd on a non-blocking communicator
// hands the launch to a helper thread and returns ncclInProgress; nccl_all_to_all polls
// until the launch is done, so the kernels are in the stream when it returns and no
// other call touches the communicator while that thread runs. blocking=true (Python
// passes ULYSSES_KERNELS_NCCL_BLOCKING, read when the communicator is created) selects
// NCCL's blocking mode instead (launches in the calling thread; init and first-use connection
// setup can then hang instead of timing out) as a fallback should non-blocking mode
// misbehave with a given NCCL version or inside CUDA graph capture.
//
// The ops never hold the GIL while they wait: torch.ops releases it around every call.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

namespace ulysses_kernels {
namespace {

struct Comm {
  ncclComm_t comm = nullptr;
  int device = 0;
  int64_t world = 0;
  int64_t rank = 0;
  double timeout_s = 600.0;
  bool aborted = false;
  cudaEvent_t event = nullptr;  // used by nccl_comm_wait
};

std::mutex g_mutex;
std::unordered_map<int64_t, std::shared_ptr<Comm>> g_comms;
int64_t g_next_handle = 1;

std::string nccl_error(ncclComm_t comm, ncclResult_t r) {
  std::string msg = ncclGetErrorString(r);
  const char* last = comm ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  if (last && *last) msg += std::string(" (") + last + ")";
  return msg;
}

void abort_comm(Comm& c) {
  if (c.comm && !c.aborted) {
    ncclCommAbort(c.comm);
    c.aborted = true;
  }
}

// Back-off for host polling loops: spin (yield) for the first ~0.5 ms, since a launch
// by NCCL's helper thread usually completes within tens of microseconds, then sleep.
void poll_pause(int iteration) {
  if (iteration < 2000) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Poll the communicator until it leaves ncclInProgress; raise on error or timeout.
void wait_ready(Comm& c, const char* what, double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  for (int iteration = 0;; ++iteration) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c.comm, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      const std::string msg = nccl_error(c.comm, state);
      abort_comm(c);
      TORCH_CHECK(false, "ulysses_kernels NCCL ", what, " failed on rank ", c.rank, "/", c.world, ": ", msg);
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s) {
      abort_comm(c);
      TORCH_CHECK(false, "ulysses_kernels NCCL ", what, " timed out after ", timeout_s, " s on rank ", c.rank,
                  "/", c.world, " (a peer did not join, or the ranks disagree on the exchange); "
                  "the communicator was aborted");
    }
    poll_pause(iteration);
  }
}

void check_nccl_call(Comm& c, ncclResult_t r, const char* what) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  const std::string msg = nccl_error(c.comm, r);
  abort_comm(c);
  TORCH_CHECK(false, "ulysses_kernels NCCL ", what, " failed on rank ", c.rank, "/", c.world, ": ", msg);
}

std::shared_ptr<Comm> get_comm(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_comms.find(handle);
  TORCH_CHECK(it != g_comms.end(), "ulysses_kernels: NCCL communicator handle ", handle,
              " is not open (closed already, or never created)");
  TORCH_CHECK(!it->second->aborted, "ulysses_kernels: NCCL communicator ", handle,
              " was aborted after an earlier error or timeout; create a new one");
  return it->second;
}

}  // namespace

at::Tensor nccl_unique_id() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  TORCH_CHECK(r == ncclSuccess, "ncclGetUniqueId failed: ", ncclGetErrorString(r));
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(id.internal))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr(), id.internal, sizeof(id.internal));
  return out;
}

int64_t nccl_comm_create(const at::Tensor& unique_id, int64_t world, int64_t rank, int64_t device,
                         double timeout_s, bool blocking) {
  TORCH_CHECK(unique_id.device().is_cpu() && unique_id.scalar_type() == at::kByte && unique_id.is_contiguous() &&
                  unique_id.numel() == static_cast<int64_t>(sizeof(ncclUniqueId::internal)),
              "nccl_comm_create: unique_id must be the ", sizeof(ncclUniqueId::internal),
              "-byte CPU uint8 tensor from nccl_unique_id()");
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "nccl_comm_create: bad rank ", rank, " of world ", world);
  TORCH_CHECK(timeout_s > 0, "nccl_comm_create: timeout must be positive");
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data_ptr(), sizeof(id.internal));
  auto c = std::make_shared<Comm>();
  c->device = static_cast<int>(device);
  c->world = world;
  c->rank = rank;
  c->timeout_s = timeout_s;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking ? 1 : 0;
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, static_cast<int>(world), id, static_cast<int>(rank), &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string msg = nccl_error(c->comm, r);
    if (c->comm) ncclCommAbort(c->comm);
    TORCH_CHECK(false, "ulysses_kernels: ncclCommInitRankConfig failed on rank ", rank, "/", world, ": ", msg);
  }
  wait_ready(*c, "communicator init", timeout_s);
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&c->event, cudaEventDisableTiming));
  std::lock_guard<std::mutex> lock(g_mutex);
  const int64_t handle = g_next_handle++;
  g_comms[handle] = c;
  return handle;
}

void nccl_comm_destroy(int64_t handle) {
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_comms.find(handle);
    if (it == g_comms.end()) return;  // idempotent
    c = it->second;
    g_comms.erase(it);
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c->device));
  if (c->event) {
    cudaEventDestroy(c->event);
    c->event = nullptr;
  }
  if (c->aborted) return;  // ncclCommAbort already freed it
  ncclResult_t r = ncclCommFinalize(c->comm);
  if (r == ncclSuccess || r == ncclInProgress) {
    try {
      // Capped: at interpreter exit a peer may be gone already; do not wait 10 minutes.
      wait_ready(*c, "communicator finalize", c->timeout_s < 30.0 ? c->timeout_s : 30.0);
    } catch (...) {
      return;  // wait_ready aborted (and so freed) the communicator
    }
    ncclCommDestroy(c->comm);
  } else {
    abort_comm(*c);
  }
  c->comm = nullptr;
}

void nccl_all_to_all(int64_t handle, const at::Tensor& send, const at::Tensor& recv, at::IntArrayRef send_counts,
                     at::IntArrayRef recv_counts) {
  auto c = get_comm(handle);
  TORCH_CHECK(send.is_cuda() && recv.is_cuda(), "nccl_all_to_all: tensors must be on CUDA");
  TORCH_CHECK(send.device().index() == c->device && recv.device().index() == c->device,
              "nccl_all_to_all: tensors are on ", send.device(), "/", recv.device(), " but the communicator is on cuda:",
              c->device);
  TORCH_CHECK(send.scalar_type() == recv.scalar_type(), "nccl_all_to_all: send and recv dtypes differ");
  TORCH_CHECK(send.is_contiguous() && recv.is_contiguous(), "nccl_all_to_all: tensors must be contiguous");
  TORCH_CHECK(static_cast<int64_t>(send_counts.size()) == c->world &&
                  static_cast<int64_t>(recv_counts.size()) == c->world,
              "nccl_all_to_all: need ", c->world, " send and recv counts");
  int64_t send_total = 0, recv_total = 0;
  for (int64_t p = 0; p < c->world; ++p) {
    TORCH_CHECK(send_counts[p] >= 0 && recv_counts[p] >= 0, "nccl_all_to_all: negative count");
    send_total += send_counts[p];
    recv_total += recv_counts[p];
  }
  TORCH_CHECK(send_total <= send.numel() && recv_total <= recv.numel(), "nccl_all_to_all: counts (", send_total,
              " sent, ", recv_total, " received) exceed the buffers (", send.numel(), ", ", recv.numel(), ")");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c->device));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(c->device).stream();
  const size_t elem = send.element_size();
  const char* sptr = static_cast<const char*>(send.data_ptr());
  char* rptr = static_cast<char*>(recv.data_ptr());
  check_nccl_call(*c, ncclGroupStart(), "ncclGroupStart");
  // An error inside the group must still close it (ncclGroupEnd) before the abort:
  // NCCL's group depth is per thread, and an unterminated group would swallow every
  // later NCCL call of this thread (torch's own ProcessGroupNCCL included).
  ncclResult_t first_error = ncclSuccess;
  const char* failed_call = nullptr;
  int64_t soff = 0, roff = 0;
  for (int64_t p = 0; p < c->world && first_error == ncclSuccess; ++p) {
    if (send_counts[p] > 0) {
      ncclResult_t r = ncclSend(sptr + soff * elem, static_cast<size_t>(send_counts[p]) * elem, ncclInt8,
                                static_cast<int>(p), c->comm, stream);
      if (r != ncclSuccess && r != ncclInProgress) { first_error = r; failed_call = "ncclSend"; break; }
    }
    if (recv_counts[p] > 0) {
      ncclResult_t r = ncclRecv(rptr + roff * elem, static_cast<size_t>(recv_counts[p]) * elem, ncclInt8,
                                static_cast<int>(p), c->comm, stream);
      if (r != ncclSuccess && r != ncclInProgress) { first_error = r; failed_call = "ncclRecv"; break; }
    }
    soff += send_counts[p];
    roff += recv_counts[p];
  }
  ncclResult_t r = ncclGroupEnd();
  if (first_error != ncclSuccess) {
    if (r == ncclInProgress) {
      try {
        wait_ready(*c, "all-to-all (group close after an error)", c->timeout_s);
      } catch (...) {
      }
    }
    check_nccl_call(*c, first_error, failed_call);  // aborts and throws
  }
  check_nccl_call(*c, r, "all-to-all (ncclGroupEnd)");
  if (r == ncclInProgress) wait_ready(*c, "all-to-all enqueue", c->timeout_s);
}

void nccl_comm_wait(int64_t handle, double timeout_s) {
  auto c = get_comm(handle);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c->device));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(c->device).stream();
  C10_CUDA_CHECK(cudaEventRecord(c->event, stream));
  const auto start = std::chrono::steady_clock::now();
  for (int iteration = 0;; ++iteration) {
    cudaError_t q = cudaEventQuery(c->event);
    if (q == cudaSuccess) break;
    TORCH_CHECK(q == cudaErrorNotReady, "nccl_comm_wait: CUDA error ", cudaGetErrorString(q));
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(c->comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      const std::string msg = nccl_error(c->comm, state);
      abort_comm(*c);
      TORCH_CHECK(false, "ulysses_kernels NCCL error on rank ", c->rank, "/", c->world, ": ", msg);
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s) {
      abort_comm(*c);
      TORCH_CHECK(false, "ulysses_kernels NCCL all-to-all did not complete within ", timeout_s, " s on rank ",
                  c->rank, "/", c->world, " (a peer is missing or the ranks disagree); the communicator was aborted");
    }
    poll_pause(iteration);
  }
}

}  // namespace ulysses_kernels

TORCH_LIBRARY_FRAGMENT(ulysses_kernels, m) {
  m.def("nccl_unique_id() -> Tensor", &ulysses_kernels::nccl_unique_id);
  m.def("nccl_comm_create(Tensor unique_id, int world, int rank, int device, float timeout_s, bool blocking) -> int",
        &ulysses_kernels::nccl_comm_create);
  m.def("nccl_comm_destroy(int comm) -> ()", &ulysses_kernels::nccl_comm_destroy);
  m.def("nccl_all_to_all(int comm, Tensor send, Tensor(a!) recv, int[] send_counts, int[] recv_counts) -> ()");
  m.def("nccl_comm_wait(int comm, float timeout_s) -> ()", &ulysses_kernels::nccl_comm_wait);
}

TORCH_LIBRARY_IMPL(ulysses_kernels, CUDA, m) {
  m.impl("nccl_all_to_all", &ulysses_kernels::nccl_all_to_all);
}
