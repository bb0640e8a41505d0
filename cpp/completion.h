// What the torch side keeps of one op while the engine runs it: its future
// and output tensors, its staged (device) tensors and their stream and
// events, its timing. Shared by backend.cc (which fills it) and
// completion.cc (which finishes it and provides the device primitives).
#pragma once
#include "rustc10d/cpp/shim.h"
#include "rustc10d/cpp/torch_compat.h"
#include "rustc10d/src/ffi/mod.rs.h"

#include <ATen/core/ivalue.h>
#include <atomic>
#include <chrono>
#include <deque>
#include <optional>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace rustc10d {

c10::SourceLocation here(const char* fn);

// The exception torch's own backends raise for an error of this kind.
std::exception_ptr error_of(ErrorKind kind, const std::string& msg);

// A Store for the engine, from one torch hands a backend (split).
std::unique_ptr<StoreRef> store_ref_of(c10::intrusive_ptr<c10d::Store> store);

// When an op started and how long it took (ms; negative until it succeeds).
struct OpTiming {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::atomic<float> duration_ms{-1.0f};
};

// How a CUDA op is ordered against the caller's streams, through c10's
// device-generic interface only (no CUDA headers, no CUDA link dependency):
// copies run on rustc10d's own stream for the device, after the caller's
// stream as it was at issue (`ready`); `done` marks the copies back.
// Stream-ordered (RUSTC10D_CUDA_WAIT=stream), an op's consumers are ordered
// after its results without the host waiting: an op with copies back
// (`gated`) queued them at issue on the group's `held` stream behind the
// op's gate, and the future's events are recorded on its `side` stream
// (streams the engine made); a send's consumer may reuse its tensor once
// `sent` (its copy to the host) is done; a batch's results are its
// `members`' results.
struct DeviceSync {
  explicit DeviceSync(c10::Device d);
  // Keep the caching allocator from reusing `t`'s memory while stream `s` uses it.
  void record_use(const at::Tensor& t, const c10::Stream& s) const;
  void record_use(const at::Tensor& t) const { record_use(t, stream); }

  bool stream_ordered() const { return gated || send_ordered || !members.empty(); }
  // Make `s` wait for the op's results (stream-ordered).
  void order_after(const c10::Stream& s) const;
  // Whether the op's results are where its consumer reads them, now; and
  // block the host until they are.
  bool landed() const;
  void synchronize() const;

  c10::Device device;
  c10::Stream stream;
  c10::Event ready{c10::DeviceType::CUDA};
  c10::Event done{c10::DeviceType::CUDA};
  c10::Event sent{c10::DeviceType::CUDA};
  std::optional<c10::Stream> held, side;
  std::atomic<bool> gated{false};
  bool send_ordered = false;
  std::vector<std::shared_ptr<DeviceSync>> members;
};

// A device tensor and the host copy the engine works on.
struct Staged {
  at::Tensor device;
  at::Tensor host;
};

struct Completion::Impl {
  std::shared_ptr<DeviceSync> cuda;  // set for CUDA ops
  std::vector<Staged> staged;        // by index, as in the Call
  std::deque<c10::Event> events;     // the copies to the host, by event id
  std::shared_ptr<compat::CompletionHooks> hooks;
  uint64_t key = 0;
  std::shared_ptr<OpTiming> timing = std::make_shared<OpTiming>();
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::vector<at::Tensor> outputs;                           // what the future carries
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // CPU: (user tensor, contiguous copy)
  std::vector<at::Tensor> keep_alive;
  at::Tensor sparse;  // a sparse all-reduce's tensor (its result replaces it)
};

}  // namespace rustc10d
