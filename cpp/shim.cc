// The torch side of rustc10d: a c10d::Backend and c10d::Work that translate
// tensors into descriptors for the Rust engine and its results back into
// torch's terms. No algorithm and no socket lives here.
#include "rustc10d/cpp/shim.h"
#include "rustc10d/cpp/torch_compat.h"
#include "rustc10d/src/ffi.rs.h"

#include <ATen/core/ivalue.h>
#include <cstdlib>
#include <deque>
#include <map>
#include <optional>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

namespace rustc10d {
namespace {

using c10d::OpType;
using std::chrono::milliseconds;

c10::SourceLocation here(const char* fn) {
  return c10::SourceLocation{fn, __FILE__, static_cast<uint32_t>(__LINE__)};
}

std::exception_ptr dist_error(const std::string& msg) {
  return std::make_exception_ptr(c10::DistBackendError(here(__func__), msg));
}

int64_t to_ms(milliseconds t) {
  return t.count();
}

}  // namespace

struct StoreRef::Impl {
  c10::intrusive_ptr<c10d::Store> store;
};
StoreRef::~StoreRef() = default;

// When an op started and how long it took (ms; negative until it finishes).
struct OpTiming {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::atomic<float> duration_ms{-1.0f};
};

// RUSTC10D_CUDA=0 refuses CUDA tensors, for users who want them to fail
// rather than be staged through host memory.
constexpr const char* kEnvCuda = "RUSTC10D_CUDA";

bool cuda_enabled() {
  const char* v = std::getenv(kEnvCuda);
  return v == nullptr || std::string(v) != "0";
}

// Tests only: stage CPU tensors exactly as CUDA tensors are staged (copied in
// by the engine's gate, copied back on completion), host memory standing in
// for device memory, so CI exercises that path without a GPU.
constexpr const char* kEnvTestStaging = "RUSTC10D_TEST_STAGING";

bool test_staging() {
  static const bool on = [] {
    const char* v = std::getenv(kEnvTestStaging);
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// How a CUDA op is ordered against the caller's streams, through c10's
// device-generic interface only (no CUDA headers, no CUDA link dependency).
// Tensors are staged through pinned host memory on rustc10d's own stream:
// device -> host after the work the caller had queued (the `ready` event),
// host -> device after the network part; `done` marks the copies back.
struct DeviceSync {
  explicit DeviceSync(c10::Device d) : device(d), stream(stream_for(d)) {}

  // One stream per device for the process: a later op's copies to the host
  // then queue behind an earlier op's copies back.
  static c10::Stream stream_for(c10::Device d) {
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

  // Keep the caching allocator from reusing `t`'s memory while our stream uses it.
  void record_use(const at::Tensor& t) const {
    if (t.defined() && t.storage().data_ptr().get()) {
      c10::impl::getDeviceGuardImpl(device.type())->recordDataPtrOnStream(t.storage().data_ptr(), stream);
    }
  }

  c10::Device device;
  c10::Stream stream;
  c10::Event ready{c10::DeviceType::CUDA};  // the caller's stream at issue time
  c10::Event done{c10::DeviceType::CUDA};   // the copies back, once the op succeeded
};

struct Completion::Impl {
  std::shared_ptr<DeviceSync> cuda;                             // set for CUDA ops
  std::vector<std::pair<at::Tensor, at::Tensor>> stage_in;       // (device tensor, host copy) to fill first
  std::shared_ptr<compat::CompletionHooks> hooks;
  uint64_t key = 0;
  std::shared_ptr<OpTiming> timing;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::vector<at::Tensor> outputs;                             // what the future carries
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;    // (user tensor, staged copy)
  std::vector<at::Tensor> keep_alive;                          // staged inputs
  std::function<void()> on_success;                             // result assembly, if any
  std::optional<c10::Event> staged;                              // a CUDA send's copy to the host
  size_t piece_bytes = 0;                                        // staged in pieces of this size (0: whole)
  bool pieces_whole = false;                                     // ... but copied in and out whole
  std::deque<c10::Event> piece_staged;                           // CUDA: piece i is on the host
};
Completion::~Completion() = default;

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

std::unique_ptr<StoreRef> store_from_python(size_t pyobject) {
  auto ref = std::make_unique<StoreRef>();
  ref->impl = std::make_unique<StoreRef::Impl>();
  auto handle = py::handle(reinterpret_cast<PyObject*>(pyobject));
  ref->impl->store = handle.cast<c10::intrusive_ptr<c10d::Store>>();
  return ref;
}

namespace {

// Queue copies of (device tensor, host copy) pairs to the host on
// rustc10d's stream, after the caller's queued work; the returned event
// marks them done.
c10::Event queue_to_host(DeviceSync* sync, const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs) {
  c10::StreamGuard guard(sync->stream);
  sync->ready.block(sync->stream);
  for (auto& [device, host] : pairs) {
    host.copy_(device, /*non_blocking=*/true);
    sync->record_use(device);
  }
  c10::Event staged(c10::DeviceType::CUDA);
  staged.record(sync->stream);
  return staged;
}

// The same, waited for. Without `sync` (RUSTC10D_TEST_STAGING) host memory
// stands in for the device.
void copy_to_host(DeviceSync* sync, const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs) {
  if (pairs.empty()) return;
  if (!sync) {
    for (auto& [device, host] : pairs) host.copy_(device);
    return;
  }
  queue_to_host(sync, pairs).synchronize();
}

}  // namespace

// The engine thread calls this just before the op runs. Nothing to do for
// ops on CPU tensors.
void stage_inputs(const Completion& done) { copy_to_host(done.impl->cuda.get(), done.impl->stage_in); }

namespace {

// Bytes [i * piece, (i + 1) * piece) of a contiguous tensor.
at::Tensor piece_of(const at::Tensor& t, size_t piece, size_t i) {
  at::Tensor bytes = t.reshape({-1}).view(at::kByte);
  auto start = static_cast<int64_t>(i * piece);
  TORCH_CHECK(start < bytes.numel(), "rustc10d: piece ", i, " is past the end of the tensor");
  return bytes.narrow(0, start, std::min<int64_t>(static_cast<int64_t>(piece), bytes.numel() - start));
}

}  // namespace

// Pieces need one staged buffer that is both the op's input and its result
// (all_reduce, broadcast). On CUDA every piece's copy to the host is queued
// now, each with an event; without a device (RUSTC10D_TEST_STAGING) piece_in
// copies the piece itself. A non-contiguous tensor has no byte ranges: it is
// copied whole (in before piece 0, back on completion), but the op still runs
// in pieces, because every rank must cut an op the same way.
bool stage_pieces(const Completion& done, size_t bytes) {
  auto& d = *done.impl;
  if (bytes == 0 || d.on_success || d.stage_in.size() != 1 || d.copy_back.size() != 1) return false;
  auto& [device, host] = d.stage_in[0];
  if (!device.is_same(d.copy_back[0].first) || !host.is_same(d.copy_back[0].second)) return false;
  d.piece_bytes = bytes;
  d.pieces_whole = !device.is_contiguous();
  if (!d.cuda) return true;
  if (d.pieces_whole) {
    d.piece_staged.push_back(queue_to_host(d.cuda.get(), d.stage_in));
    return true;
  }
  for (size_t i = 0; i * bytes < static_cast<size_t>(host.nbytes()); ++i) {
    d.piece_staged.push_back(queue_to_host(d.cuda.get(), {{piece_of(device, bytes, i), piece_of(host, bytes, i)}}));
  }
  return true;
}

// A send's copy was queued at issue (Staging::stage_later); the sending
// thread waits for it here. Without a device, the copy happens here.
void await_staged(const Completion& done) {
  auto& d = *done.impl;
  if (d.staged) {
    d.staged->synchronize();
  } else {
    copy_to_host(nullptr, d.stage_in);
  }
  d.stage_in.clear();
}

void piece_in(const Completion& done, size_t i) {
  auto& d = *done.impl;
  if (d.pieces_whole && i > 0) return;  // all of it came in with piece 0
  if (d.cuda) {
    TORCH_CHECK(i < d.piece_staged.size(), "rustc10d: piece ", i, " was never staged");
    d.piece_staged[i].synchronize();
  } else if (d.pieces_whole) {
    copy_to_host(nullptr, d.stage_in);
  } else {
    auto& [device, host] = d.stage_in[0];
    piece_of(host, d.piece_bytes, i).copy_(piece_of(device, d.piece_bytes, i));
  }
}

void piece_out(const Completion& done, size_t i) {
  auto& d = *done.impl;
  if (d.pieces_whole) return;  // copied back whole on completion
  auto& [user, host] = d.copy_back[0];
  std::optional<c10::StreamGuard> on_our_stream;
  if (d.cuda) on_our_stream.emplace(d.cuda->stream);
  piece_of(user, d.piece_bytes, i).copy_(piece_of(host, d.piece_bytes, i), /*non_blocking=*/d.cuda != nullptr);
  if (d.cuda) d.cuda->record_use(user);
}

void complete(std::unique_ptr<Completion> done, rust::Str error) noexcept {
  auto& d = *done->impl;
  try {
    if (error.empty()) {
      std::optional<c10::StreamGuard> on_our_stream;
      if (d.cuda) on_our_stream.emplace(d.cuda->stream);  // copies back and the future's events go there
      // An op run in pieces has copied each back already (piece_out).
      if (d.piece_bytes && !d.pieces_whole) d.copy_back.clear();
      for (auto& [user, staged] : d.copy_back) {
        user.copy_(staged, /*non_blocking=*/d.cuda != nullptr);
        if (d.cuda) d.cuda->record_use(user);
      }
      if (d.cuda) d.cuda->done.record(d.cuda->stream);
      if (d.on_success) d.on_success();
      std::chrono::duration<float, std::milli> took = std::chrono::steady_clock::now() - d.timing->start;
      d.timing->duration_ms = took.count();
      d.future->markCompleted(c10::IValue(d.outputs));
      d.hooks->fire(d.key, took.count());
    } else {
      d.future->setError(dist_error(std::string(error)));
    }
  } catch (...) {
    if (!d.future->completed()) d.future->setError(std::current_exception());
  }
}

namespace {

class RustWork final : public compat::Work {
 public:
  RustWork(int rank, OpType type, rust::Box<Op> op, c10::intrusive_ptr<c10::ivalue::Future> future,
           std::vector<at::Tensor> outputs, uint64_t key, std::shared_ptr<OpTiming> timing,
           std::shared_ptr<DeviceSync> cuda)
      : compat::Work(rank, type, key),
        op_(std::move(op)),
        future_(std::move(future)),
        outputs_(std::move(outputs)),
        timing_(std::move(timing)),
        cuda_(std::move(cuda)) {}

  float getDuration() const override {
    float ms = timing_->duration_ms;
    TORCH_CHECK(ms >= 0, "rustc10d: getDuration(): the op has not completed successfully");
    return ms;
  }

  // A CUDA op is complete once its results are back on the device.
  bool isCompleted() override { return op_->is_done() && (!cuda_ || !isSuccess() || cuda_->done.query()); }

  bool isSuccess() const override { return op_->is_done() && op_->error_message().empty(); }

  std::exception_ptr exception() const override {
    if (!op_->is_done()) return nullptr;
    auto msg = std::string(op_->error_message());
    return msg.empty() ? nullptr : dist_error(msg);
  }

  int sourceRank() const override {
    TORCH_CHECK(op_->source_rank() != -1, "rustc10d: sourceRank() is only defined for send/recv work");
    TORCH_CHECK(op_->source_rank() >= 0, "rustc10d: sourceRank(): this any-source recv has not matched yet; wait() first");
    return static_cast<int>(op_->source_rank());
  }

  std::vector<at::Tensor> result() override { return outputs_; }

  // torch's kNoTimeout (0 ms) means: until the op finishes or its own timeout.
  // A CUDA op's wait returns once the network part is done and its copies
  // back are queued: the caller's current stream waits for them, the host
  // does not (synchronize() does).
  bool wait(milliseconds timeout = kNoTimeout) override {
    int64_t ms = timeout == kNoTimeout ? -1 : to_ms(timeout);
    switch (op_->wait(ms)) {
      case 0:
        if (cuda_) cuda_->done.block(c10::impl::getDeviceGuardImpl(cuda_->device.type())->getStream(cuda_->device));
        return true;
      case 1:
        throw c10::DistBackendError(here(__func__), std::string(op_->error_message()));
      default:
        throw c10::DistBackendError(
            here(__func__), c10::str("rustc10d: Timed out after ", ms, " ms in Work.wait; the ",
                                     c10d::opTypeToString(opType_), " op is still running"));
    }
  }

  void synchronize() override {
    wait();
    if (cuda_) cuda_->done.synchronize();
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  uint64_t getSequencenumber() const override { return op_->seq(); }

 private:
  rust::Box<Op> op_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<OpTiming> timing_;
  std::shared_ptr<DeviceSync> cuda_;
};

// The engine's dtype codes; reductions need one, data movement does not.
constexpr uint8_t kOpaque = 255;

uint8_t dtype_code(at::ScalarType type) {
  static const std::pair<at::ScalarType, uint8_t> codes[] = {
      {at::kFloat, 0}, {at::kDouble, 1}, {at::kHalf, 2}, {at::kBFloat16, 3}, {at::kChar, 4},
      {at::kByte, 5},  {at::kShort, 6},  {at::kInt, 7},  {at::kLong, 8},     {at::kBool, 9}};
  for (auto [t, code] : codes) {
    if (t == type) return code;
  }
  return kOpaque;
}

TensorDesc desc_of(const at::Tensor& t) {
  return TensorDesc{reinterpret_cast<size_t>(t.data_ptr()), t.nbytes(), dtype_code(t.scalar_type())};
}

// `n` equal consecutive blocks of a contiguous tensor's storage.
std::vector<TensorDesc> split_desc(const TensorDesc& whole, size_t n, const char* op) {
  TORCH_CHECK(n > 0 && whole.nbytes % n == 0, "rustc10d: ", op, ": a tensor of ", whole.nbytes,
              " bytes does not split into ", n, " equal blocks");
  std::vector<TensorDesc> out;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(TensorDesc{whole.ptr + i * (whole.nbytes / n), whole.nbytes / n, whole.dtype});
  }
  return out;
}

// Blocks of a contiguous tensor cut along dim 0 by `splits` (rows); empty: equal.
std::vector<TensorDesc> split_rows(const at::Tensor& t, const TensorDesc& whole, std::vector<int64_t> splits,
                                   size_t world, const char* op) {
  if (splits.empty()) return split_desc(whole, world, op);
  TORCH_CHECK(splits.size() == world, "rustc10d: ", op, ": expected ", world, " split sizes, got ", splits.size());
  int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  int64_t total = 0;
  for (auto s : splits) {
    TORCH_CHECK(s >= 0, "rustc10d: ", op, ": negative split size ", s);
    total += s;
  }
  TORCH_CHECK(total == rows, "rustc10d: ", op, ": split sizes sum to ", total, " but the tensor has ", rows, " rows");
  size_t row_bytes = rows == 0 ? 0 : whole.nbytes / rows;
  std::vector<TensorDesc> out;
  size_t off = 0;
  for (auto s : splits) {
    out.push_back(TensorDesc{whole.ptr + off, static_cast<size_t>(s) * row_bytes, whole.dtype});
    off += s * row_bytes;
  }
  return out;
}

// Everything one op needs on the torch side: the tensors it reads (staged
// contiguous if necessary), the tensors it writes (staged, copied back on
// success), and the future/Completion pair that finishing it completes.
class Staging {
 public:
  Staging(const char* op, std::vector<at::Tensor> results) : op_(op) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    done_ = std::make_unique<Completion>();
    done_->impl = std::make_unique<Completion::Impl>();
    done_->impl->timing = timing_;
    done_->impl->future = future_;
    done_->impl->outputs = results;
    results_ = std::move(results);
  }

  // input: read by the op; output: read and written in place; result: only
  // written, every byte of it (its old contents are never copied in).
  TensorDesc input(const at::Tensor& t) { return stage(t, Access::kRead); }
  TensorDesc output(const at::Tensor& t) { return stage(t, Access::kReadWrite); }
  TensorDesc result(const at::Tensor& t) { return stage(t, Access::kWrite); }
  template <typename Ts>
  std::vector<TensorDesc> inputs(const Ts& ts) { return stage_all(ts, Access::kRead); }
  template <typename Ts>
  std::vector<TensorDesc> outputs(const Ts& ts) { return stage_all(ts, Access::kReadWrite); }
  template <typename Ts>
  std::vector<TensorDesc> results(const Ts& ts) { return stage_all(ts, Access::kWrite); }

  // The engine's half; `key` identifies the op to completion hooks.
  // Runs when the engine finished successfully, before the future completes.
  void on_success(std::function<void()> f) { done_->impl->on_success = std::move(f); }

  std::unique_ptr<Completion> completion(std::shared_ptr<compat::CompletionHooks> hooks, uint64_t key) {
    if (cuda_) {
      // A future that knows the device: its value becomes usable on a stream
      // only after the copies back (events recorded on our stream).
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                         std::vector<c10::Device>{cuda_->device});
      done_->impl->future = future_;
      done_->impl->cuda = cuda_;
    }
    key_ = key;
    done_->impl->hooks = std::move(hooks);
    done_->impl->key = key;
    return std::move(done_);
  }

  c10::intrusive_ptr<c10d::Work> work(int rank, OpType type, rust::Box<Op> op) {
    return c10::make_intrusive<RustWork>(rank, type, std::move(op), future_, results_, key_, timing_, cuda_);
  }

  const char* name() const { return op_; }

  // A send does not pass the engine's gate: queue its copy to the host now,
  // for the sending thread to wait on (await_staged). True if there is one.
  bool stage_later() {
    auto& d = *done_->impl;
    if (d.stage_in.empty()) return false;
    if (cuda_) d.staged.emplace(queue_to_host(cuda_.get(), d.stage_in));
    return true;
  }

 private:
  enum class Access { kRead, kReadWrite, kWrite };

  TensorDesc stage(const at::Tensor& t, Access access) {
    TORCH_CHECK(t.layout() == at::kStrided, "rustc10d: ", op_, " does not support ", t.layout(),
                " tensors; pass a dense (strided) tensor");
    TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "rustc10d: ", op_, " does not support tensors on ",
                t.device(), "; pass CPU or CUDA tensors");
    if (!device_) device_ = t.device();
    TORCH_CHECK(t.device() == *device_, "rustc10d: ", op_, " got tensors on ", *device_, " and on ", t.device(),
                "; all tensors of one op must be on the same device");
    if (t.device().is_cuda() || test_staging()) return stage_device(t, access);
    at::Tensor staged = t.is_contiguous()           ? t
                        : access == Access::kWrite ? at::empty(t.sizes(), t.options())
                                                    : t.contiguous();
    done_->impl->keep_alive.push_back(staged);
    if (access != Access::kRead && !staged.is_same(t)) done_->impl->copy_back.emplace_back(t, staged);
    return desc_of(staged);
  }

  // A pinned host copy the engine works on: filled from the device by the
  // gate (stage_inputs), copied back by complete().
  TensorDesc stage_device(const at::Tensor& t, Access access) {
    if (t.device().is_cuda()) {
      TORCH_CHECK(cuda_enabled(), "rustc10d: ", op_, " got a tensor on ", t.device(), ", but CUDA tensors are "
                  "turned off by ", kEnvCuda, "=0; unset it to stage them through host memory");
      if (!cuda_) {
        cuda_ = std::make_shared<DeviceSync>(t.device());
        cuda_->ready.record(c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device()));
      }
    }
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.device().is_cuda()));
    done_->impl->keep_alive.push_back(t);
    done_->impl->keep_alive.push_back(host);
    if (access != Access::kWrite) done_->impl->stage_in.emplace_back(t, host);
    if (access != Access::kRead) done_->impl->copy_back.emplace_back(t, host);
    return desc_of(host);
  }

  template <typename Ts>
  std::vector<TensorDesc> stage_all(const Ts& ts, Access access) {
    std::vector<TensorDesc> out;
    for (const auto& t : ts) out.push_back(stage(t, access));
    return out;
  }

  const char* op_;
  std::optional<c10::Device> device_;
  std::shared_ptr<DeviceSync> cuda_;
  std::shared_ptr<OpTiming> timing_ = std::make_shared<OpTiming>();
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::unique_ptr<Completion> done_;
  std::vector<at::Tensor> results_;
  uint64_t key_ = 0;
};

ReduceSpec spec_of(const c10d::ReduceOp& op, const std::vector<TensorDesc>& ds, const char* name) {
  for (auto& d : ds) {
    TORCH_CHECK(d.dtype != kOpaque, "rustc10d: ", name, " does not support reductions on this dtype yet");
    TORCH_CHECK(d.dtype == ds[0].dtype, "rustc10d: ", name, ": all tensors must have the same dtype");
  }
  double premul = 1.0;
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM) {
    auto* s = dynamic_cast<compat::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(s && !s->tensor_factor.defined(),
                "rustc10d: ", name, " supports PREMUL_SUM with a Python scalar factor only");
    premul = s->double_factor;
  }
  return ReduceSpec{static_cast<uint8_t>(op.op_), premul};
}

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

// Waits for the Works issued between startCoalescing() and endCoalescing().
class CoalescedWork final : public c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : Work(rank, OpType::COALESCED), works_(std::move(works)) {
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (auto& w : works_) futures.push_back(w->getFuture());
    auto list = c10::List<c10::intrusive_ptr<c10::ivalue::Future>>(c10::FutureType::create(c10::ListType::create(c10::TensorType::get())));
    for (auto& f : futures) list.push_back(f);
    auto all = c10::collectAll(list);
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    std::vector<at::Tensor> results;
    for (auto& w : works_) {
      auto r = w->result();
      results.insert(results.end(), r.begin(), r.end());
    }
    all->addCallback([fut = future_, results](c10::ivalue::Future& done) {
      for (const c10::IValue& f : done.value().toList().vec()) {
        auto one = f.toFuture();
        if (one->hasError()) {
          fut->setError(one->exception_ptr());
          return;
        }
      }
      fut->markCompleted(c10::IValue(results));
    });
  }

  bool isCompleted() override {
    for (auto& w : works_)
      if (!w->isCompleted()) return false;
    return true;
  }
  bool isSuccess() const override {
    for (auto& w : works_)
      if (!w->isSuccess()) return false;
    return true;
  }
  std::exception_ptr exception() const override {
    for (auto& w : works_)
      if (auto e = w->exception()) return e;
    return nullptr;
  }
  // One deadline for the whole batch, not `timeout` per Work.
  bool wait(milliseconds timeout = kNoTimeout) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto& w : works_) {
      if (timeout == kNoTimeout) {
        w->wait();
        continue;
      }
      auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      w->wait(std::max(left, milliseconds(1)));
    }
    return true;
  }
  void synchronize() override { wait(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class RustBackend final : public compat::Backend<RustBackend> {
 public:
  RustBackend(rust::Box<Group> group, int rank, int size)
      : compat::Backend<RustBackend>(rank, size), group_(std::move(group)) {}

  ~RustBackend() override { stop(); }

  // destroy_process_group() and abort: fail what is pending, close sockets, join threads.
  void shutdown() override { stop(); }
  void abort() override { stop(); }

  const std::string getBackendName() const override { return "rustc10d"; }
  bool supportsCoalescing() const override { return true; }
  uint64_t getSequenceNumberForGroup() override { return group_->sequence_number(); }
  void setSequenceNumberForGroup() override {}  // starts at 0 on every rank
  void setTimeout(milliseconds timeout) override {
    group_->set_timeout(to_ms(timeout));
  }

  void startCoalescing() override {
    TORCH_CHECK(!coalescing_, "rustc10d: startCoalescing() called twice without endCoalescing()");
    coalescing_ = true;
    coalesced_.clear();
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    TORCH_CHECK(coalescing_, "rustc10d: endCoalescing() without startCoalescing()");
    coalescing_ = false;
    return c10::make_intrusive<CoalescedWork>(getRank(), std::move(coalesced_));
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1 && tensors[0].layout() == at::kSparse) return allreduce_sparse(tensors, opts);
    return dense_allreduce(tensors, opts, "allreduce", OpType::ALLREDUCE);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    return dense_allreduce(tensors, opts, "allreduce_coalesced", OpType::ALLREDUCE_COALESCED);
  }

  // SUM of sparse COO tensors, as Gloo does it: gather every rank's indices and
  // values (after a round that tells each rank's nnz), then let torch coalesce.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    auto& t = single(tensors, "allreduce_sparse");
    TORCH_CHECK(t.layout() == at::kSparse && t.device().is_cpu(),
                "rustc10d: allreduce_sparse takes a sparse COO tensor on the CPU");
    TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "rustc10d: allreduce on sparse tensors supports SUM only");
    auto input = t.coalesce();
    auto indices = input.indices().t().contiguous();  // [nnz, sparse_dim]: one block per rank
    auto values = input.values().contiguous();         // [nnz, dense...]
    size_t w = getSize();

    auto counts = at::empty({static_cast<int64_t>(w)}, at::kLong);
    {
      auto nnz = at::full({1}, input._nnz(), at::kLong);
      Staging s("allreduce_sparse", {});
      auto i = s.input(nnz);
      auto os = split_desc(s.result(counts), w, s.name());
      run(s, OpType::_ALLREDUCE_SPARSE, [&](auto done) {
        return group_->all_gather(slice1(i), slice(os), to_ms(opts.timeout), std::move(done));
      })->wait();
    }

    auto rows = counts.sum().item<int64_t>();
    auto idx_shape = indices.sizes().vec();
    auto val_shape = values.sizes().vec();
    idx_shape[0] = val_shape[0] = rows;
    auto all_idx = at::empty(idx_shape, indices.options());
    auto all_val = at::empty(val_shape, values.options());
    Staging s("allreduce_sparse", {t});
    std::vector<TensorDesc> is{s.input(indices), s.input(values)};
    std::vector<int64_t> per_rank(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + w);
    std::vector<TensorDesc> os = split_rows(all_idx, s.result(all_idx), per_rank, w, s.name());
    auto vs = split_rows(all_val, s.result(all_val), per_rank, w, s.name());
    os.insert(os.end(), vs.begin(), vs.end());
    auto sizes = t.sizes().vec();
    s.on_success([t, all_idx, all_val, sizes]() mutable {
      t.copy_(at::sparse_coo_tensor(all_idx.t(), all_val, sizes).coalesce());
    });
    return run(s, OpType::_ALLREDUCE_SPARSE, [&](auto done) {
      return group_->all_gather(slice(is), slice(os), to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    auto& t = single(tensors, "reduce");
    Staging s("reduce", {t});
    auto d = s.output(t);
    auto spec = spec_of(opts.reduceOp, {d}, s.name());
    return run(s, OpType::REDUCE, [&](auto done) {
      return group_->reduce(d, opts.rootRank, spec, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto& t = single(tensors, "broadcast");
    Staging s("broadcast", {t});
    auto d = s.output(t);
    return run(s, OpType::BROADCAST, [&](auto done) {
      return group_->broadcast(d, opts.rootRank, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    auto& in = single(inputs, "allgather");
    TORCH_CHECK(outputs.size() == 1, "rustc10d: allgather takes one output list, got ", outputs.size());
    Staging s("allgather", outputs[0]);
    auto i = s.input(in);
    auto os = s.results(outputs[0]);
    return run(s, OpType::ALLGATHER, [&](auto done) {
      return group_->all_gather(slice1(i), slice(os), to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    Staging s("all_gather_into_tensor", {output});
    auto i = s.input(input);
    auto os = split_desc(s.result(output), getSize(), s.name());
    return run(s, OpType::_ALLGATHER_BASE, [&](auto done) {
      return group_->all_gather(slice1(i), slice(os), to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    // outputs[r][j] is rank r's copy of input j; the engine wants them by input.
    TORCH_CHECK(outputs.size() == static_cast<size_t>(getSize()), "rustc10d: allgather_coalesced expects ",
                getSize(), " output lists, got ", outputs.size());
    std::vector<at::Tensor> by_input;
    for (size_t j = 0; j < inputs.size(); ++j) {
      for (auto& per_rank : outputs) {
        TORCH_CHECK(per_rank.size() == inputs.size(), "rustc10d: allgather_coalesced: each output list needs ",
                    inputs.size(), " tensors");
        by_input.push_back(per_rank[j]);
      }
    }
    Staging s("allgather_coalesced", flatten(outputs));
    auto is = s.inputs(inputs);
    auto os = s.results(by_input);
    return run(s, OpType::ALLGATHER_COALESCED, [&](auto done) {
      return group_->all_gather(slice(is), slice(os), to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    Staging s("allgather_into_tensor_coalesced", outputs);
    auto is = s.inputs(inputs);
    std::vector<TensorDesc> os;
    for (auto& o : outputs) {
      auto blocks = split_desc(s.result(o), getSize(), s.name());
      os.insert(os.end(), blocks.begin(), blocks.end());
    }
    return run(s, compat::kAllgatherIntoTensorCoalesced, [&](auto done) {
      return group_->all_gather(slice(is), slice(os), to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    auto& in = single(inputs, "gather");
    bool root = opts.rootRank == getRank();
    auto results = root && !outputs.empty() ? outputs[0] : std::vector<at::Tensor>{};
    Staging s("gather", results);
    auto i = s.input(in);
    auto os = s.results(results);
    return run(s, OpType::GATHER, [&](auto done) {
      return group_->gather(i, slice(os), opts.rootRank, to_ms(opts.timeout), std::move(done));
    });
  }

  // torch's gather_into_tensor, where it has one (see compat::Backend).
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts) {
    bool root = opts.rootRank == getRank();
    Staging s("gather_into_tensor", root ? std::vector<at::Tensor>{output} : std::vector<at::Tensor>{});
    auto i = s.input(input);
    auto os = root ? split_desc(s.result(output), getSize(), s.name()) : std::vector<TensorDesc>{};
    return run(s, OpType::GATHER, [&](auto done) {
      return group_->gather(i, slice(os), opts.rootRank, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    auto& out = single(outputs, "scatter");
    bool root = opts.rootRank == getRank();
    Staging s("scatter", {out});
    auto is = root && !inputs.empty() ? s.inputs(inputs[0]) : std::vector<TensorDesc>{};
    auto o = s.result(out);
    return run(s, OpType::SCATTER, [&](auto done) {
      return group_->scatter(slice(is), o, opts.rootRank, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto& out = single(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1, "rustc10d: reduce_scatter takes one input list, got ", inputs.size());
    Staging s("reduce_scatter", {out});
    auto is = s.inputs(inputs[0]);
    auto o = s.result(out);
    check_same_dtype(is, o, s.name());
    auto spec = spec_of(opts.reduceOp, {o}, s.name());
    return run(s, OpType::REDUCE_SCATTER, [&](auto done) {
      return group_->reduce_scatter(slice(is), slice1(o), spec, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    Staging s("reduce_scatter_tensor", {output});
    auto is = split_desc(s.input(input), getSize(), s.name());
    auto o = s.result(output);
    check_same_dtype(is, o, s.name());
    auto spec = spec_of(opts.reduceOp, {o}, s.name());
    return run(s, OpType::_REDUCE_SCATTER_BASE, [&](auto done) {
      return group_->reduce_scatter(slice(is), slice1(o), spec, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    Staging s("reduce_scatter_tensor_coalesced", outputs);
    std::vector<TensorDesc> is;
    for (auto& i : inputs) {
      auto blocks = split_desc(s.input(i), getSize(), s.name());
      is.insert(is.end(), blocks.begin(), blocks.end());
    }
    auto os = s.results(outputs);
    check_same_dtype(is, os.empty() ? TensorDesc{} : os[0], s.name());
    auto spec = spec_of(opts.reduceOp, os, s.name());
    return run(s, compat::kReduceScatterTensorCoalesced, [&](auto done) {
      return group_->reduce_scatter(slice(is), slice(os), spec, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override {
    Staging s("all_to_all_single", {output});
    size_t w = getSize();
    auto is = split_rows(input, s.input(input), inputSplits, w, s.name());
    auto os = split_rows(output, s.result(output), outputSplits, w, s.name());
    return run(s, OpType::ALLTOALL_BASE, [&](auto done) {
      return group_->all_to_all(slice(is), slice(os), to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    Staging s("all_to_all", outputs);
    auto is = s.inputs(inputs);
    auto os = s.results(outputs);
    return run(s, OpType::ALLTOALL, [&](auto done) {
      return group_->all_to_all(slice(is), slice(os), to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    Staging s("barrier", {});
    return run(s, OpType::BARRIER, [&](auto done) { return group_->barrier(to_ms(opts.timeout), std::move(done)); });
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    Staging s("monitored_barrier", {});
    run(s, OpType::BARRIER, [&](auto done) {
      return group_->monitored_barrier(waitAllRanks, to_ms(opts.timeout), std::move(done));
    })->wait();
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto& t = single(tensors, "send");
    Staging s("send", {t});
    auto d = s.input(t);
    bool staged = s.stage_later();
    return run(s, OpType::SEND, [&](auto done) { return group_->send(d, dst, tag, -1, staged, std::move(done)); });
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto& t = single(tensors, "recv");
    Staging s("recv", {t});
    auto d = s.result(t);
    return run(s, OpType::RECV, [&](auto done) { return group_->recv(d, src, tag, -1, std::move(done)); });
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    auto& t = single(tensors, "recv");
    Staging s("recv", {t});
    auto d = s.result(t);
    return run(s, OpType::RECVANYSOURCE, [&](auto done) { return group_->recv(d, -1, tag, -1, std::move(done)); });
  }

 private:
  static at::Tensor& single(std::vector<at::Tensor>& tensors, const char* op) {
    TORCH_CHECK(tensors.size() == 1, "rustc10d: ", op, " takes exactly one tensor, got ", tensors.size());
    return tensors[0];
  }

  // One engine op per tensor, one Work for all of them.
  c10::intrusive_ptr<c10d::Work> dense_allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts,
                                                 const char* name, OpType type) {
    Staging s(name, tensors);
    auto ds = s.outputs(tensors);
    auto spec = spec_of(opts.reduceOp, ds, s.name());
    return run(s, type, [&](auto done) {
      return group_->all_reduce(slice(ds), spec, to_ms(opts.timeout), std::move(done));
    });
  }

  static rust::Slice<const TensorDesc> slice(const std::vector<TensorDesc>& v) {
    return rust::Slice<const TensorDesc>(v.data(), v.size());
  }
  static rust::Slice<const TensorDesc> slice1(const TensorDesc& d) { return rust::Slice<const TensorDesc>(&d, 1); }

  static void check_same_dtype(const std::vector<TensorDesc>& inputs, const TensorDesc& output, const char* op) {
    for (auto& i : inputs) {
      TORCH_CHECK(i.dtype == output.dtype, "rustc10d: ", op, ": input and output dtypes differ");
    }
  }

  // Hand the op to the engine and wrap it in a Work (remembered while coalescing).
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> run(Staging& s, OpType type, Call call) {
    rust::Box<Op> op = [&] {
      try {
        return call(s.completion(hooks_, next_key_++));
      } catch (const rust::Error& e) {
        throw c10::Error(here(s.name()), e.what());
      }
    }();
    auto work = s.work(getRank(), type, std::move(op));
    if (coalescing_) coalesced_.push_back(work);
    return work;
  }

  void stop() {
    // Engine threads may be finishing futures whose callbacks need the GIL.
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      group_->shutdown();
    } else {
      group_->shutdown();
    }
  }

  rust::Box<Group> group_;
  std::atomic<uint64_t> next_key_{1};
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
};

}  // namespace

size_t backend_to_python(rust::Box<Group> group, int32_t rank, int32_t size) {
  c10::intrusive_ptr<c10d::Backend> backend = c10::make_intrusive<RustBackend>(std::move(group), rank, size);
  return reinterpret_cast<size_t>(py::cast(backend).release().ptr());
}

}  // namespace rustc10d
