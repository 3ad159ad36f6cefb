// NCCL communicator of the fused Ulysses path (docs/architecture.md, "Fused path").
//
// One communicator per sequence-parallel group, owned by a torch custom class that Python
// holds (ulysses_kernels/fused/transport.py; the engine keeps the transport, the comm
// stream, the reusable buffers and the events: fused/engine.py). The object's lifetime is
// the communicator's: `close()`, or the release of the last reference, finalizes it, so a
// transport Python forgets frees its communicator. The all-to-all is an op that reaches the communicator
// through the object's `handle()`: a small integer registered while the object lives (the
// registry holds weak references only), so the op keeps a plain schema that fake
// implementations, torch.compile and CUDA graph capture can use.
//
// The communicator is created in NCCL's non-blocking mode, so every wait is one poll loop
// (`poll`) over ncclCommGetAsyncError with a timeout: a peer that never arrives, or an NCCL
// error, becomes a Python exception (after ncclCommAbort) instead of a hang. Every NCCL
// failure goes through one place (`fail`): the message names the call, the rank and NCCL's
// own error text, the communicator is aborted, then the error is raised.
//
//   torch.classes.ulysses_kernels.NcclCommunicator(Tensor unique_id, int world, int rank, int device,
//                                                  float timeout_s, bool blocking)
//     .handle() -> int      the id nccl_all_to_all takes
//     .wait(float timeout_s) -> ()
//                           host wait (with timeout) for the work queued so far on the current
//                           stream; raises if NCCL reported an error or the timeout expires.
//                           Not for graph capture.
//     .close() -> ()        finalize and free the communicator (idempotent; also when the last
//                           reference is released); raises if finalizing fails (after the abort)
//   nccl_unique_id() -> Tensor                      128 uint8 bytes, CPU (rank 0 makes it)
//   nccl_all_to_all(int comm, Tensor send, Tensor(a!) recv, int[] send_counts, int[] recv_counts) -> ()
//       grouped ncclSend/ncclRecv on the *current* CUDA stream (the caller makes its comm
//       stream current); counts are elements per peer, offsets their prefix sums.
//       No host synchronisation, so it can be captured in a CUDA graph.
//
// Non-blocking mode and NCCL >= 2.19: every ncclGroupEnd on a non-blocking communicator
// hands the launch to a helper thread and returns ncclInProgress; all_to_all polls until
// the launch is done, so the kernels are in the stream when it returns and no other call
// touches the communicator while that thread runs. blocking=true (Python passes
// ULYSSES_KERNELS_NCCL_BLOCKING, read when the communicator is created) selects NCCL's
// blocking mode instead (launches in the calling thread; init and first-use connection
// setup can then hang instead of timing out) as a fallback should non-blocking mode
// misbehave with a given NCCL version or inside CUDA graph capture.
//
// The ops never hold the GIL while they wait: torch.ops releases it around every call.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

namespace ulysses_kernels {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Back-off for host polling: spin (yield) for the first ~0.5 ms, since a launch by NCCL's
// helper thread usually completes within tens of microseconds, then sleep.
void poll_pause(int iteration) {
  if (iteration < 2000) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool in_flight(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }

}  // namespace

class NcclCommunicator : public torch::CustomClassHolder {
 public:
  NcclCommunicator(const at::Tensor& unique_id, int64_t world, int64_t rank, int64_t device, double timeout_s,
                   bool blocking)
      : device_(static_cast<int>(device)), world_(world), rank_(rank), timeout_s_(timeout_s) {
    TORCH_CHECK(unique_id.device().is_cpu() && unique_id.scalar_type() == at::kByte && unique_id.is_contiguous() &&
                    unique_id.numel() == static_cast<int64_t>(sizeof(ncclUniqueId::internal)),
                "NcclCommunicator: unique_id must be the ", sizeof(ncclUniqueId::internal),
                "-byte CPU uint8 tensor from nccl_unique_id()");
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "NcclCommunicator: bad rank ", rank, " of world ", world);
    TORCH_CHECK(timeout_s > 0, "NcclCommunicator: timeout must be positive");
    ncclUniqueId id;
    std::memcpy(id.internal, unique_id.data_ptr(), sizeof(id.internal));
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    check(ncclCommInitRankConfig(&comm_, static_cast<int>(world), id, static_cast<int>(rank), &config),
          "ncclCommInitRankConfig");
    poll("communicator init", timeout_s_, [](ncclResult_t state) { return state == ncclSuccess; });
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }

  // The last Python reference is gone: c10 calls this before the destructor (which runs
  // only once the registry's weak reference is gone too), so the communicator is freed now.
  void release_resources() override {
    try {
      close();
    } catch (...) {  // never throws from here; close() already aborted what it could not finalize
    }
  }

  ~NcclCommunicator() override { release_resources(); }

  // Registered on the first call, once an intrusive_ptr owns the object (Python's, which
  // calls this right after construction): the registry can then hold a weak reference.
  int64_t handle() {
    if (handle_ == 0) handle_ = register_handle();
    return handle_;
  }

  // Finalizes and frees the communicator (idempotent). Raises when finalizing fails (a peer
  // is gone, an NCCL error): the communicator is aborted, and so freed, first.
  void close() {
    unregister_handle();
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    if (event_ != nullptr) {
      cudaEventDestroy(event_);
      event_ = nullptr;
    }
    if (comm_ == nullptr) return;  // closed already, or freed by an abort
    const ncclResult_t finalize = ncclCommFinalize(comm_);
    if (!in_flight(finalize)) fail("communicator finalize", finalize);  // aborts, then raises
    // Capped: at interpreter exit a peer may be gone already; do not wait 10 minutes.
    poll("communicator finalize", timeout_s_ < 30.0 ? timeout_s_ : 30.0,
         [](ncclResult_t state) { return state == ncclSuccess; });
    ncclCommDestroy(comm_);
    comm_ = nullptr;
  }

  void wait(double timeout_s) {
    usable();
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    C10_CUDA_CHECK(cudaEventRecord(event_, at::cuda::getCurrentCUDAStream(device_).stream()));
    poll("all-to-all", timeout_s, [this](ncclResult_t) {
      const cudaError_t q = cudaEventQuery(event_);
      TORCH_CHECK(q == cudaSuccess || q == cudaErrorNotReady, "NcclCommunicator.wait: CUDA error ",
                  cudaGetErrorString(q));
      return q == cudaSuccess;
    });
  }

  void all_to_all(const at::Tensor& send, const at::Tensor& recv, at::IntArrayRef send_counts,
                  at::IntArrayRef recv_counts) {
    usable();
    check_exchange(send, recv, send_counts, recv_counts);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(device_).stream();
    const size_t elem = send.element_size();
    const char* sptr = static_cast<const char*>(send.data_ptr());
    char* rptr = static_cast<char*>(recv.data_ptr());
    check(ncclGroupStart(), "ncclGroupStart");
    // An error inside the group must still close it (ncclGroupEnd) before the abort:
    // NCCL's group depth is per thread, and an unterminated group would swallow every
    // later NCCL call of this thread (torch's own ProcessGroupNCCL included).
    ncclResult_t first_error = ncclSuccess;
    const char* failed_call = nullptr;
    int64_t soff = 0, roff = 0;
    for (int64_t p = 0; p < world_ && first_error == ncclSuccess; ++p) {
      if (send_counts[p] > 0) {
        const ncclResult_t r = ncclSend(sptr + soff * elem, static_cast<size_t>(send_counts[p]) * elem, ncclInt8,
                                        static_cast<int>(p), comm_, stream);
        if (!in_flight(r)) { first_error = r; failed_call = "ncclSend"; }
      }
      if (first_error == ncclSuccess && recv_counts[p] > 0) {
        const ncclResult_t r = ncclRecv(rptr + roff * elem, static_cast<size_t>(recv_counts[p]) * elem, ncclInt8,
                                        static_cast<int>(p), comm_, stream);
        if (!in_flight(r)) { first_error = r; failed_call = "ncclRecv"; }
      }
      soff += send_counts[p];
      roff += recv_counts[p];
    }
    const ncclResult_t end = ncclGroupEnd();
    if (first_error != ncclSuccess) {
      if (end == ncclInProgress) {
        // NCCL's helper thread may still be launching what the group holds: let it finish
        // before the abort (bounded; its own failure is superseded by the first error).
        try {
          poll("all-to-all (group close after an error)", timeout_s_, [](ncclResult_t state) { return state == ncclSuccess; });
        } catch (...) {
        }
      }
      fail(failed_call, first_error);
    }
    check(end, "all-to-all (ncclGroupEnd)");
    if (end == ncclInProgress) {
      poll("all-to-all enqueue", timeout_s_, [](ncclResult_t state) { return state == ncclSuccess; });
    }
  }

 private:
  // The one error path of every NCCL call: format the message, abort, raise.
  [[noreturn]] void fail(const char* what, ncclResult_t r) {
    std::string msg = ncclGetErrorString(r);
    const char* last = ncclGetLastError(comm_);
    if (last != nullptr && *last != '\0') msg += std::string(" (") + last + ")";
    abort();
    TORCH_CHECK(false, "ulysses_kernels NCCL ", what, " failed on rank ", rank_, "/", world_, ": ", msg);
    __builtin_unreachable();
  }

  // NCCL_CHECK: success and in-progress pass, anything else fails.
  void check(ncclResult_t r, const char* what) {
    if (!in_flight(r)) fail(what, r);
  }

  // The communicator's state: ncclCommGetAsyncError's answer, or its own failure.
  ncclResult_t async_state() const {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    return r != ncclSuccess ? r : state;
  }

  // The one poll loop: until `finished(state)`, raising on an NCCL error or after
  // `timeout_s` (the communicator is aborted first in both cases).
  template <typename Finished>
  void poll(const char* what, double timeout_s, Finished finished) {
    const auto start = std::chrono::steady_clock::now();
    for (int iteration = 0;; ++iteration) {
      const ncclResult_t state = async_state();
      if (!in_flight(state)) fail(what, state);
      if (finished(state)) return;
      if (seconds_since(start) > timeout_s) {
        abort();
        TORCH_CHECK(false, "ulysses_kernels NCCL ", what, " timed out after ", timeout_s, " s on rank ", rank_, "/",
                    world_, " (a peer did not join, or the ranks disagree on the exchange); "
                    "the communicator was aborted");
      }
      poll_pause(iteration);
    }
  }

  void abort() {
    unregister_handle();
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  void usable() const {
    TORCH_CHECK(comm_ != nullptr, "ulysses_kernels: NCCL communicator ", handle_,
                " is closed (after close(), or aborted after an earlier error or timeout); create a new one");
  }

  void check_exchange(const at::Tensor& send, const at::Tensor& recv, at::IntArrayRef send_counts,
                      at::IntArrayRef recv_counts) const {
    TORCH_CHECK(send.is_cuda() && recv.is_cuda(), "nccl_all_to_all: tensors must be on CUDA");
    TORCH_CHECK(send.device().index() == device_ && recv.device().index() == device_, "nccl_all_to_all: tensors are on ",
                send.device(), "/", recv.device(), " but the communicator is on cuda:", device_);
    TORCH_CHECK(send.scalar_type() == recv.scalar_type(), "nccl_all_to_all: send and recv dtypes differ");
    TORCH_CHECK(send.is_contiguous() && recv.is_contiguous(), "nccl_all_to_all: tensors must be contiguous");
    TORCH_CHECK(static_cast<int64_t>(send_counts.size()) == world_ &&
                    static_cast<int64_t>(recv_counts.size()) == world_,
                "nccl_all_to_all: need ", world_, " send and recv counts");
    int64_t send_total = 0, recv_total = 0;
    for (int64_t p = 0; p < world_; ++p) {
      TORCH_CHECK(send_counts[p] >= 0 && recv_counts[p] >= 0, "nccl_all_to_all: negative count");
      send_total += send_counts[p];
      recv_total += recv_counts[p];
    }
    TORCH_CHECK(send_total <= send.numel() && recv_total <= recv.numel(), "nccl_all_to_all: counts (", send_total,
                " sent, ", recv_total, " received) exceed the buffers (", send.numel(), ", ", recv.numel(), ")");
  }

  int64_t register_handle();
  void unregister_handle();

  ncclComm_t comm_ = nullptr;
  cudaEvent_t event_ = nullptr;  // NcclCommunicator.wait's marker
  int device_;
  int64_t world_;
  int64_t rank_;
  double timeout_s_;
  int64_t handle_ = 0;
};

namespace {

// Live communicators by handle. Weak references: the Python object owns its communicator.
// Never destroyed (a communicator released during interpreter teardown still finds it).
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, c10::weak_intrusive_ptr<NcclCommunicator>> live;
  int64_t next_handle = 1;
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

c10::intrusive_ptr<NcclCommunicator> find(int64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.live.find(handle);
  auto comm = it == r.live.end() ? c10::intrusive_ptr<NcclCommunicator>() : it->second.lock();
  TORCH_CHECK(comm, "ulysses_kernels: NCCL communicator handle ", handle,
              " is not open (closed already, aborted after an error, or never created)");
  return comm;
}

}  // namespace

int64_t NcclCommunicator::register_handle() {
  usable();
  const auto self = c10::intrusive_ptr<NcclCommunicator>::unsafe_reclaim_from_nonowning(this);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t handle = r.next_handle++;
  r.live.emplace(handle, c10::weak_intrusive_ptr<NcclCommunicator>(self));
  return handle;
}

// Dropping the registry's weak reference here is safe inside release_resources(): the
// strong references' own weak count keeps the object until release_resources returns.
void NcclCommunicator::unregister_handle() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live.erase(handle_);
}

at::Tensor nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  TORCH_CHECK(r == ncclSuccess, "ncclGetUniqueId failed: ", ncclGetErrorString(r));
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(id.internal))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr(), id.internal, sizeof(id.internal));
  return out;
}

void nccl_all_to_all(int64_t comm, const at::Tensor& send, const at::Tensor& recv, at::IntArrayRef send_counts,
                     at::IntArrayRef recv_counts) {
  find(comm)->all_to_all(send, recv, send_counts, recv_counts);
}

}  // namespace ulysses_kernels

TORCH_LIBRARY_FRAGMENT(ulysses_kernels, m) {
  m.class_<ulysses_kernels::NcclCommunicator>("NcclCommunicator")
      .def(torch::init<at::Tensor, int64_t, int64_t, int64_t, double, bool>())
      .def("handle", &ulysses_kernels::NcclCommunicator::handle)
      .def("wait", &ulysses_kernels::NcclCommunicator::wait)
      .def("close", &ulysses_kernels::NcclCommunicator::close);
  m.def("nccl_unique_id() -> Tensor", &ulysses_kernels::nccl_unique_id);
  m.def("nccl_all_to_all(int comm, Tensor send, Tensor(a!) recv, int[] send_counts, int[] recv_counts) -> ()");
}

TORCH_LIBRARY_IMPL(ulysses_kernels, CUDA, m) {
  m.impl("nccl_all_to_all", &ulysses_kernels::nccl_all_to_all);
}
