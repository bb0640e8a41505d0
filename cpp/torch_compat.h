// What differs between the torch releases rustc10d builds against (2.11 to
// 2.15), in one place. build_shim.py looks for each feature in the headers of
// the torch it builds a shim against and defines RUSTC10D_TORCH_HAS_<FEATURE>
// to 0 or 1 (see TORCH_FEATURES there); no other file reads those macros. What a torch
// lacks is left out, never imitated: on 2.11 the backend simply has no
// completion hooks and no gather_into_tensor, as torch's own backends there.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if !defined(RUSTC10D_TORCH_HAS_COMPLETION_HOOKS) || !defined(RUSTC10D_TORCH_HAS_COMPLETION_KEY) || \
    !defined(RUSTC10D_TORCH_HAS_PREMUL_SUM_SUPPLEMENT) || !defined(RUSTC10D_TORCH_HAS_TENSOR_COALESCED_OPTYPES) || \
    !defined(RUSTC10D_TORCH_HAS_GATHER_INTO_TENSOR) || !defined(RUSTC10D_TORCH_HAS_RECONFIGURE) ||      \
    !defined(RUSTC10D_TORCH_HAS_STREAM_CAPTURE_QUERY) || !defined(RUSTC10D_TORCH_HAS_ABORT_HOOKS) ||          \
    !defined(RUSTC10D_TORCH_HAS_GET_ERROR) || !defined(RUSTC10D_TORCH_HAS_ABORT_HOOKS_QUERY)
#error "build_shim.py defines every RUSTC10D_TORCH_HAS_* feature macro"
#endif

namespace rustc10d::compat {

// Whether `s` is being captured into a CUDA graph, where torch can say
// (nullopt: ask the driver).
inline std::optional<bool> is_capturing(const c10::Stream& s) {
#if RUSTC10D_TORCH_HAS_STREAM_CAPTURE_QUERY
  return c10::impl::getDeviceGuardImpl(s.device_type())->isStreamCapturing(s);
#else
  (void)s;
  return std::nullopt;
#endif
}

// PREMUL_SUM's factor; torch 2.11 to 2.14 call it NCCLPreMulSumSupplement.
#if RUSTC10D_TORCH_HAS_PREMUL_SUM_SUPPLEMENT
using PreMulSumSupplement = c10d::PreMulSumSupplement;
#else
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
#endif

// The OpType of the tensor-coalesced collectives. A torch without their own
// OpTypes labels them COALESCED, as its NCCL backend does.
#if RUSTC10D_TORCH_HAS_TENSOR_COALESCED_OPTYPES
constexpr c10d::OpType kAllgatherIntoTensorCoalesced = c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED;
constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
constexpr c10d::OpType kAllgatherIntoTensorCoalesced = c10d::OpType::COALESCED;
constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::COALESCED;
#endif

// Hooks of one kind registered with one backend, by torch's hook id.
template <class Hook>
class HookTable {
 public:
  void add(int64_t id, Hook hook) {
    std::lock_guard<std::mutex> lock(mu_);
    hooks_[id] = std::move(hook);
  }
  void remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    hooks_.erase(id);
  }
  // f(hook) for each, under the lock.
  template <class F>
  void each(F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, hook] : hooks_) f(hook);
  }

 private:
  std::mutex mu_;
  std::map<int64_t, Hook> hooks_;
};

// The completion hooks registered with one backend (torch's flight recorder
// registers them), fired when an op succeeds. Holds nothing on a torch
// without them.
class CompletionHooks {
 public:
#if RUSTC10D_TORCH_HAS_COMPLETION_HOOKS
  void add(int64_t id, c10d::CompletionHook hook) { table_.add(id, std::move(hook)); }
  void remove(int64_t id) { table_.remove(id); }
  void fire(uint64_t key, float duration_ms) {
    table_.each([&](auto& hook) { hook(c10d::CompletionHookArgs{key, duration_ms}); });
  }

 private:
  HookTable<c10d::CompletionHook> table_;
#else
  void fire(uint64_t, float) {}
#endif
};

// The abort hooks registered with one backend (torch 2.14 on: debug information
// captured before an abort), run when the group is aborted. A hook that
// throws is reported and the others still run. Holds nothing on a torch
// without them.
class AbortHooks {
 public:
#if RUSTC10D_TORCH_HAS_ABORT_HOOKS
  void add(int64_t id, c10d::AbortHook hook) { table_.add(id, std::move(hook)); }
  void remove(int64_t id) { table_.remove(id); }
  // Run outside the table's lock: a hook may take the GIL, or unregister itself.
  void fire() {
    std::vector<c10d::AbortHook> hooks;
    table_.each([&](auto& hook) { hooks.push_back(hook); });
    for (auto& hook : hooks) {
      try {
        hook();
      } catch (const std::exception& e) {
        TORCH_WARN("rustc10d: an abort hook raised: ", e.what());
      }
    }
  }

 private:
  HookTable<c10d::AbortHook> table_;
#else
  void fire() {}
#endif
};

// c10d::Backend plus the virtuals that only some releases declare. `Impl`
// (the real backend) provides gather_single(), the gather into one tensor,
// and reconfigure_handle() and reconfigure_to(handles, ordered, uuid,
// timeout_ms), torch's reconfigure with its options taken apart, which
// returns the new rank and size (torch before 2.14 keeps them const).
template <class Impl>
class Backend : public c10d::Backend {
 public:
  using c10d::Backend::Backend;

#if RUSTC10D_TORCH_HAS_COMPLETION_HOOKS
  bool supportsCompletionHooks() const override { return true; }
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override { hooks_->add(id, std::move(hook)); }
  void unregisterCompletionHook(int64_t id) override { hooks_->remove(id); }
#endif

#if RUSTC10D_TORCH_HAS_ABORT_HOOKS_QUERY
  bool supportsAbortHooks() const override { return true; }
#endif
#if RUSTC10D_TORCH_HAS_ABORT_HOOKS
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override { abort_hooks_->add(id, std::move(hook)); }
  void unregisterAbortHook(int64_t id) override { abort_hooks_->remove(id); }
#endif

#if RUSTC10D_TORCH_HAS_GET_ERROR
  // `Impl` says what broke the group as torch's ErrorType's value (0: nothing).
  c10d::ErrorType getError() override { return static_cast<c10d::ErrorType>(static_cast<Impl*>(this)->error_type()); }
#endif

#if RUSTC10D_TORCH_HAS_GATHER_INTO_TENSOR
  c10::intrusive_ptr<c10d::Work> gather_into_tensor(at::Tensor& output, at::Tensor& input,
                                                    const c10d::GatherOptions& opts) override {
    return static_cast<Impl*>(this)->gather_single(output, input, opts);
  }
#endif

#if RUSTC10D_TORCH_HAS_RECONFIGURE
  bool supportsReconfigure() const override { return true; }
  c10d::ReconfigureHandle get_reconfigure_handle() const override {
    return static_cast<const Impl*>(this)->reconfigure_handle();
  }
  // A list of handles places ranks by position; a set leaves the order to us.
  // Hints name nothing rustc10d has, and are ignored.
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override {
    std::vector<std::string> handles;
    std::visit([&](const auto& given) { handles.assign(given.begin(), given.end()); }, opts.handles);
    const bool ordered = std::holds_alternative<std::vector<c10d::ReconfigureHandle>>(opts.handles);
    const int64_t timeout_ms = opts.timeout ? opts.timeout->count() : -1;
    std::tie(rank_, size_) = static_cast<Impl*>(this)->reconfigure_to(handles, ordered, opts.uuid, timeout_ms);
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    done->markCompleted(c10::IValue(std::vector<at::Tensor>()));
    return c10d::Work::create_from_future(done);
  }
#endif

 protected:
  std::shared_ptr<CompletionHooks> hooks_ = std::make_shared<CompletionHooks>();
  std::shared_ptr<AbortHooks> abort_hooks_ = std::make_shared<AbortHooks>();
};

// c10d::Work plus the completion key that identifies it to completion hooks,
// where torch has one.
class Work : public c10d::Work {
 public:
  Work(int rank, c10d::OpType type, uint64_t key) : c10d::Work(rank, type), key_(key) {}

#if RUSTC10D_TORCH_HAS_COMPLETION_KEY
  uint64_t getCompletionKey() const override { return key_; }
#endif

 private:
  uint64_t key_;
};

}  // namespace rustc10d::compat
