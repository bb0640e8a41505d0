// The torch side of rustc10d: a c10d::Backend and c10d::Work that translate
// tensors into descriptors for the Rust engine and its results back into
// torch's terms. No algorithm and no socket lives here.
#include "rustc10d/cpp/shim.h"
#include "rustc10d/src/ffi.rs.h"

#include <ATen/core/ivalue.h>
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

// Engine failures surface as torch.distributed.DistBackendError.
[[noreturn]] void rethrow_engine_error(const rust::Error& e) {
  throw c10::DistBackendError(here(__func__), e.what());
}

int64_t to_ms(milliseconds t) {
  return t.count();
}

}  // namespace

struct StoreRef::Impl {
  c10::intrusive_ptr<c10d::Store> store;
};
StoreRef::~StoreRef() = default;

struct Completion::Impl {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::vector<at::Tensor> outputs;                             // what the future carries
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;    // (user tensor, staged copy)
  std::vector<at::Tensor> keep_alive;                          // staged inputs
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

void complete(std::unique_ptr<Completion> done, rust::Str error) noexcept {
  auto& d = *done->impl;
  try {
    if (error.empty()) {
      for (auto& [user, staged] : d.copy_back) user.copy_(staged);
      d.future->markCompleted(c10::IValue(d.outputs));
    } else {
      d.future->setError(dist_error(std::string(error)));
    }
  } catch (...) {
    if (!d.future->completed()) d.future->setError(std::current_exception());
  }
}

namespace {

class RustWork final : public c10d::Work {
 public:
  RustWork(int rank, OpType type, rust::Box<Op> op, c10::intrusive_ptr<c10::ivalue::Future> future,
           std::vector<at::Tensor> outputs)
      : Work(rank, type), op_(std::move(op)), future_(std::move(future)), outputs_(std::move(outputs)) {}

  bool isCompleted() override { return op_->is_done(); }

  bool isSuccess() const override { return op_->is_done() && op_->error_message().empty(); }

  std::exception_ptr exception() const override {
    if (!op_->is_done()) return nullptr;
    auto msg = std::string(op_->error_message());
    return msg.empty() ? nullptr : dist_error(msg);
  }

  int sourceRank() const override {
    TORCH_CHECK(op_->source_rank() >= 0, "rustc10d: sourceRank() is only defined for recv work");
    return static_cast<int>(op_->source_rank());
  }

  std::vector<at::Tensor> result() override { return outputs_; }

  // torch's kNoTimeout (0 ms) means: until the op finishes or its own timeout.
  bool wait(milliseconds timeout = kNoTimeout) override {
    int64_t ms = timeout == kNoTimeout ? -1 : to_ms(timeout);
    switch (op_->wait(ms)) {
      case 0:
        return true;
      case 1:
        throw c10::DistBackendError(here(__func__), std::string(op_->error_message()));
      default:
        throw c10::DistBackendError(
            here(__func__), c10::str("rustc10d: Work.wait timed out after ", ms,
                                     " ms; the ", c10d::opTypeToString(opType_), " op is still running"));
    }
  }

  void synchronize() override { wait(); }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  uint64_t getSequencenumber() const override { return op_->seq(); }

 private:
  rust::Box<Op> op_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> outputs_;
};

TensorDesc describe(const at::Tensor& t) {
  static const std::pair<at::ScalarType, uint8_t> codes[] = {
      {at::kFloat, 0}, {at::kDouble, 1}, {at::kHalf, 2},  {at::kBFloat16, 3}, {at::kChar, 4},
      {at::kByte, 5},  {at::kShort, 6},  {at::kInt, 7},   {at::kLong, 8},     {at::kBool, 9}};
  for (auto [type, code] : codes) {
    if (t.scalar_type() == type) {
      return TensorDesc{reinterpret_cast<size_t>(t.data_ptr()), t.nbytes(), code};
    }
  }
  TORCH_CHECK(false, "rustc10d does not support dtype ", t.scalar_type(), " yet");
}

class RustBackend final : public c10d::Backend {
 public:
  RustBackend(rust::Box<Group> group, int rank, int size, milliseconds timeout)
      : Backend(rank, size), group_(std::move(group)), timeout_(timeout) {}

  ~RustBackend() override { stop(); }

  // destroy_process_group() and abort: fail what is pending, close sockets, join threads.
  void shutdown() override { stop(); }
  void abort() override { stop(); }

  const std::string getBackendName() const override { return "rustc10d"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto& t = single(tensors, "allreduce");
    uint8_t op = static_cast<uint8_t>(opts.reduceOp.op_);
    return submit(OpType::ALLREDUCE, "allreduce", t, true, [&](TensorDesc d, auto done) {
      return group_->all_reduce(d, op, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto& t = single(tensors, "broadcast");
    return submit(OpType::BROADCAST, "broadcast", t, true, [&](TensorDesc d, auto done) {
      return group_->broadcast(d, opts.rootRank, to_ms(opts.timeout), std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    auto [future, done] = prepare({});
    try {
      auto op = group_->barrier(to_ms(opts.timeout), std::move(done));
      return c10::make_intrusive<RustWork>(getRank(), OpType::BARRIER, std::move(op), future,
                                           std::vector<at::Tensor>{});
    } catch (const rust::Error& e) {
      rethrow_engine_error(e);
    }
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto& t = single(tensors, "send");
    return submit(OpType::SEND, "send", t, false, [&](TensorDesc d, auto done) {
      return group_->send(d, dst, tag, -1, std::move(done));
    });
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto& t = single(tensors, "recv");
    return submit(OpType::RECV, "recv", t, true, [&](TensorDesc d, auto done) {
      return group_->recv(d, src, tag, -1, std::move(done));
    });
  }

 private:
  static at::Tensor& single(std::vector<at::Tensor>& tensors, const char* op) {
    TORCH_CHECK(tensors.size() == 1, "rustc10d: ", op, " takes exactly one tensor, got ", tensors.size());
    auto& t = tensors[0];
    TORCH_CHECK(t.layout() == at::kStrided, "rustc10d: ", op, " does not support ", t.layout(),
                " tensors; pass a dense (strided) tensor");
    TORCH_CHECK(t.device().is_cpu(), "rustc10d: ", op, " does not support tensors on ", t.device(),
                " yet; only CPU tensors are supported");
    return t;
  }

  std::pair<c10::intrusive_ptr<c10::ivalue::Future>, std::unique_ptr<Completion>> prepare(
      std::vector<at::Tensor> outputs) {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    auto done = std::make_unique<Completion>();
    done->impl = std::make_unique<Completion::Impl>();
    done->impl->future = future;
    done->impl->outputs = std::move(outputs);
    return {future, std::move(done)};
  }

  // Stage a non-contiguous tensor through a contiguous copy (copied back on
  // success when `writes` is set), hand the engine its storage, wrap the op.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> submit(OpType type, const char* name, at::Tensor& t, bool writes, Call call) {
    at::Tensor staged = t.is_contiguous() ? t : t.contiguous();
    TensorDesc desc = describe(staged);
    auto [future, done] = prepare({t});
    done->impl->keep_alive.push_back(staged);
    if (writes && !staged.is_same(t)) done->impl->copy_back.emplace_back(t, staged);
    try {
      auto op = call(desc, std::move(done));
      return c10::make_intrusive<RustWork>(getRank(), type, std::move(op), future, std::vector<at::Tensor>{t});
    } catch (const rust::Error& e) {
      throw c10::Error(here(name), e.what());
    }
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
  milliseconds timeout_;
};

}  // namespace

size_t backend_to_python(rust::Box<Group> group, int32_t rank, int32_t size, int64_t timeout_ms) {
  c10::intrusive_ptr<c10d::Backend> backend =
      c10::make_intrusive<RustBackend>(std::move(group), rank, size, milliseconds(timeout_ms));
  return reinterpret_cast<size_t>(py::cast(backend).release().ptr());
}

}  // namespace rustc10d
