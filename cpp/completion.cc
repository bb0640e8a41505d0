// The engine's calls into torch: finishing an op (its future, its Work's
// state, completion hooks), the device primitives its staging uses, and the
// Store. What to stage and when is decided in Rust (src/engine/staging.rs).
#include "rustc10d/cpp/completion.h"

#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <c10/core/InferenceMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/utils/pybind.h>

namespace rustc10d {

using std::chrono::milliseconds;

c10::SourceLocation here(const char* fn) {
  return c10::SourceLocation{fn, __FILE__, static_cast<uint32_t>(__LINE__)};
}

// Bad input is a RuntimeError (as TORCH_CHECK makes it in torch's own
// backends), something not implemented a NotImplementedError, a lost or
// unreachable peer a DistNetworkError, any other failure of the op (a
// timeout, a mismatch, a broken group) a DistBackendError.
std::exception_ptr error_of(ErrorKind kind, const std::string& msg) {
  switch (kind) {
    case ErrorKind::InvalidArgument:
      return std::make_exception_ptr(c10::Error(here(__func__), msg));
    case ErrorKind::Unsupported:
      return std::make_exception_ptr(c10::NotImplementedError(here(__func__), msg));
    case ErrorKind::PeerLost:
    case ErrorKind::Io:
      return std::make_exception_ptr(c10::DistNetworkError(here(__func__), msg));
    default:
      return std::make_exception_ptr(c10::DistBackendError(here(__func__), msg));
  }
}

// ---------------------------------------------------------------- the Store

struct StoreRef::Impl {
  c10::intrusive_ptr<c10d::Store> store;
};
StoreRef::~StoreRef() = default;

void store_set(const StoreRef& s, rust::Str key, rust::Slice<const uint8_t> value) {
  s.impl->store->set(std::string(key), std::vector<uint8_t>(value.begin(), value.end()));
}

rust::Vec<uint8_t> store_get(const StoreRef& s, rust::Str key, int64_t timeout_ms) {
  std::string k(key);
  s.impl->store->wait({k}, milliseconds(timeout_ms));
  rust::Vec<uint8_t> out;
  for (auto b : s.impl->store->get(k)) out.push_back(b);
  return out;
}

int64_t store_add(const StoreRef& s, rust::Str key, int64_t delta) {
  return s.impl->store->add(std::string(key), delta);
}

bool store_delete(const StoreRef& s, rust::Str key) {
  return s.impl->store->deleteKey(std::string(key));
}

rust::String store_host(const StoreRef& s) {
  c10::intrusive_ptr<c10d::Store> store = s.impl->store;
  if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) {
    store = prefixed->getUnderlyingNonPrefixStore();
  }
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get())) {
    return rust::String(tcp->getHost());
  }
  return rust::String();
}

std::unique_ptr<StoreRef> store_ref_of(c10::intrusive_ptr<c10d::Store> store) {
  auto ref = std::make_unique<StoreRef>();
  ref->impl = std::make_unique<StoreRef::Impl>();
  ref->impl->store = std::move(store);
  return ref;
}

std::unique_ptr<StoreRef> store_clone(const StoreRef& s) {
  return store_ref_of(s.impl->store);
}

std::unique_ptr<StoreRef> store_from_python(size_t pyobject) {
  auto handle = py::handle(reinterpret_cast<PyObject*>(pyobject));
  return store_ref_of(handle.cast<c10::intrusive_ptr<c10d::Store>>());
}

// ---------------------------------------------------------------- devices

namespace {

// One stream per device for the process: a later op's copies to the host
// then queue behind an earlier op's copies back.
c10::Stream stream_for(c10::Device d) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(d.index());
  if (it == streams.end()) {
    auto s = c10::impl::getDeviceGuardImpl(d.type())->getStreamFromGlobalPool(d, /*isHighPriority=*/false);
    it = streams.emplace(d.index(), s).first;
  }
  return it->second;
}

// Bytes [start, start + len) of a tensor; the whole tensor (strided) when
// that is all of it, so non-contiguous tensors are copied whole.
at::Tensor bytes_of(const at::Tensor& t, size_t start, size_t len) {
  if (start == 0 && len == t.nbytes()) return t;
  TORCH_CHECK(t.is_contiguous(), "rustc10d: a byte range of a non-contiguous tensor");
  return t.reshape({-1}).view(at::kByte).narrow(0, static_cast<int64_t>(start), static_cast<int64_t>(len));
}

// Copy into `dst` from any thread. A tensor made under torch.inference_mode()
// may only be written in that mode, which is per thread: the engine's and the
// staging threads enter it for such a tensor, not the caller's mode (grad
// mode is per thread the same way: the shim writes detached aliases).
void copy_into(const at::Tensor& dst, const at::Tensor& src, bool non_blocking = false) {
  std::optional<c10::InferenceMode> inference;
  if (dst.is_inference()) inference.emplace();
  dst.copy_(src, non_blocking);
}

}  // namespace

Completion::~Completion() = default;

DeviceSync::DeviceSync(c10::Device d) : device(d), stream(stream_for(d)) {}

void DeviceSync::record_use(const at::Tensor& t, const c10::Stream& s) const {
  if (t.defined() && t.storage().data_ptr().get()) {
    c10::impl::getDeviceGuardImpl(device.type())->recordDataPtrOnStream(t.storage().data_ptr(), s);
  }
}

void DeviceSync::order_after(const c10::Stream& s) const {
  for (const auto& m : members) m->order_after(s);
  if (gated) done.block(s);
  if (send_ordered) sent.block(s);
}

bool DeviceSync::landed() const {
  for (const auto& m : members) {
    if (!m->landed()) return false;
  }
  if (gated || !stream_ordered()) return done.query();
  return !send_ordered || sent.query();
}

void DeviceSync::synchronize() const {
  for (const auto& m : members) m->synchronize();
  if (gated || !stream_ordered()) done.synchronize();
  if (send_ordered) sent.synchronize();
}

// Without a device (RUSTC10D_TEST_STAGING: host memory stands in for the
// device), copies happen at once and there are no events.
uint64_t to_host(const Completion& done, size_t buffer, size_t start, size_t len) {
  auto& d = *done.impl;
  TORCH_CHECK(buffer < d.staged.size(), "rustc10d: no staged buffer ", buffer);
  auto& [device, host] = d.staged[buffer];
  if (!d.cuda) {
    copy_into(bytes_of(host, start, len), bytes_of(device, start, len));
    return 0;
  }
  c10::StreamGuard guard(d.cuda->stream);
  d.cuda->ready.block(d.cuda->stream);
  copy_into(bytes_of(host, start, len), bytes_of(device, start, len), /*non_blocking=*/true);
  d.cuda->record_use(device);
  d.events.emplace_back(c10::DeviceType::CUDA);
  d.events.back().record(d.cuda->stream);
  d.cuda->sent.record(d.cuda->stream);  // after every copy in so far (a send's one)
  return d.events.size() - 1;
}

void wait_event(const Completion& done, uint64_t event) {
  auto& d = *done.impl;
  if (!d.cuda) return;
  TORCH_CHECK(event < d.events.size(), "rustc10d: no device copy ", event);
  d.events[event].synchronize();
}

void to_device(const Completion& done, size_t buffer, size_t start, size_t len) {
  auto& d = *done.impl;
  TORCH_CHECK(buffer < d.staged.size(), "rustc10d: no staged buffer ", buffer);
  auto& [device, host] = d.staged[buffer];
  if (!d.cuda) {
    copy_into(bytes_of(device, start, len), bytes_of(host, start, len));
    return;
  }
  c10::StreamGuard guard(d.cuda->stream);
  copy_into(bytes_of(device, start, len), bytes_of(host, start, len), /*non_blocking=*/true);
  d.cuda->record_use(device);
}

int32_t staged_device(const Completion& done) {
  auto& d = *done.impl;
  return d.cuda ? static_cast<int32_t>(d.cuda->device.index()) : -1;
}

namespace {

// A stream the engine made, as c10 knows a stream made outside torch: its
// native handle is its id (what torch.cuda.ExternalStream wraps).
c10::Stream ours(c10::Device d, size_t handle) {
  return c10::Stream(c10::Stream::UNSAFE, d, static_cast<c10::StreamId>(handle));
}

DeviceSync& cuda_of(const Completion& done, size_t buffer) {
  auto& d = *done.impl;
  TORCH_CHECK(d.cuda, "rustc10d: stream-ordered completion of an op not on a CUDA device");
  TORCH_CHECK(buffer < d.staged.size(), "rustc10d: no staged buffer ", buffer);
  return *d.cuda;
}

}  // namespace

// The op's first held copy orders the held stream after its copies in (they
// read the host buffers these copies write); `done` follows its last.
void to_device_held(const Completion& done, size_t held, size_t side, size_t buffer, size_t start, size_t len) {
  auto& sync = cuda_of(done, buffer);
  if (!sync.held) {
    sync.held = ours(sync.device, held);
    sync.side = ours(sync.device, side);
    c10::Event copied_in(c10::DeviceType::CUDA);
    copied_in.record(sync.stream);
    copied_in.block(*sync.held);
    sync.gated = true;
  }
  auto& [device, host] = done.impl->staged[buffer];
  c10::StreamGuard guard(*sync.held);
  copy_into(bytes_of(device, start, len), bytes_of(host, start, len), /*non_blocking=*/true);
  sync.record_use(device, *sync.held);
  sync.done.record(*sync.held);
}

// On the restore stream, which nothing else uses or waits for: after the
// caller's work queued before the op, and waited for here (on the gates'
// thread, in ticket order; the engine then opens the gate).
void restore(const Completion& done, size_t restore_stream, size_t buffer, size_t start, size_t len) {
  auto& sync = cuda_of(done, buffer);
  auto s = ours(sync.device, restore_stream);
  auto& [device, host] = done.impl->staged[buffer];
  c10::StreamGuard guard(s);
  sync.ready.block(s);
  copy_into(bytes_of(host, start, len), bytes_of(device, start, len), /*non_blocking=*/true);
  sync.record_use(device, s);
  c10::Event restored(c10::DeviceType::CUDA);
  restored.record(s);
  restored.synchronize();
}

// ---------------------------------------------------------------- finishing

// Finishing is two calls: `settle`, one at a time with the device
// primitives (the engine's lock on the Completion), then `publish`, without
// that lock, since it runs torch's callbacks, the user's code, which may
// issue the next op. `publish` touches only what no other call does: the
// future, the hooks, the timing `settle` wrote.

// The op succeeded: its outputs' copies back, and a CUDA op's events. Returns
// what went wrong (empty: nothing), which the op then fails with.
rust::String settle(const Completion& done) noexcept {
  auto& d = *done.impl;
  try {
    for (auto& [user, copy] : d.copy_back) copy_into(user, copy);
    // Held copies were queued at issue: the side stream waits for them, so
    // that the future's events (`publish`) do not also wait for later ops'
    // held copies.
    if (d.cuda && d.cuda->stream_ordered()) {
      d.cuda->order_after(d.cuda->side ? *d.cuda->side : d.cuda->stream);
    } else if (d.cuda) {
      d.cuda->done.record(d.cuda->stream);
    }
    std::chrono::duration<float, std::milli> took = std::chrono::steady_clock::now() - d.timing->start;
    d.timing->duration_ms = took.count();
    return rust::String();
  } catch (const std::exception& e) {
    return rust::String(std::string("rustc10d: finishing the op failed: ") + e.what());
  } catch (...) {
    return rust::String("rustc10d: finishing the op failed");
  }
}

// The op's future completes (error empty) or fails, then its hooks fire.
void publish(const Completion& done, ErrorKind kind, rust::Str error) noexcept {
  auto& d = *done.impl;
  try {
    if (!error.empty()) {
      d.future->setError(error_of(kind, std::string(error)));
      return;
    }
    // A CUDA future's value is usable on a stream once our stream's copies
    // back are done: its events are recorded on the current stream.
    std::optional<c10::StreamGuard> on_our_stream;
    if (d.cuda && d.cuda->stream_ordered()) {
      on_our_stream.emplace(d.cuda->side ? *d.cuda->side : d.cuda->stream);
    } else if (d.cuda) {
      on_our_stream.emplace(d.cuda->stream);
    }
    d.future->markCompleted(c10::IValue(d.outputs));
    d.hooks->fire(d.key, d.timing->duration_ms);
  } catch (...) {
    if (!d.future->completed()) d.future->setError(std::current_exception());
  }
}

// Every rank's rows, added up by torch: rows with equal indices sum. The
// engine checked the rows against the tensor's shape (counts, indices in
// range), so the tensor built here is valid. The result is coalesced, as
// Gloo's is. The tensor may be uncoalesced (DDP's sparse gradients are), so
// only what an uncoalesced tensor answers is asked of it.
rust::String settle_sparse(const Completion& done, rust::Slice<const uint64_t> rows,
                           rust::Slice<const uint8_t> indices, rust::Slice<const uint8_t> values) noexcept {
  auto& t = done.impl->sparse;
  std::string failed;
  try {
    at::NoGradGuard no_grad;  // the engine's thread, not the caller's grad mode
    int64_t total = 0;
    for (auto r : rows) total += static_cast<int64_t>(r);
    auto idx = at::empty({total, t.sparse_dim()}, at::kLong);
    auto val_shape = t.sizes().slice(t.sparse_dim()).vec();
    val_shape.insert(val_shape.begin(), total);
    auto val = at::empty(val_shape, at::TensorOptions().dtype(t.scalar_type()));
    TORCH_CHECK(idx.nbytes() == indices.size() && val.nbytes() == values.size(),
                "rustc10d: a sparse all-reduce gathered rows of the wrong size");
    if (!indices.empty()) std::memcpy(idx.data_ptr(), indices.data(), indices.size());
    if (!values.empty()) std::memcpy(val.data_ptr(), values.data(), values.size());
    copy_into(t, at::sparse_coo_tensor(idx.t(), val, t.sizes()).coalesce());
  } catch (const std::exception& e) {
    failed = std::string("rustc10d: allreduce_sparse could not build its result: ") + e.what();
  }
  if (failed.empty()) return settle(done);
  return rust::String(failed);
}

}  // namespace rustc10d
