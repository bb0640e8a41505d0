// The torch side of rustc10d: a c10d::Backend whose every op translates its
// tensors and options into a Call for the Rust engine, and a c10d::Work that
// reports the engine's op. No algorithm, no setting and no socket lives here.
#include "rustc10d/cpp/completion.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

namespace rustc10d {
namespace {

using c10d::OpType;
using std::chrono::milliseconds;

// Negative (kUnsetTimeout): the group's timeout.
int64_t to_ms(milliseconds t) {
  return t.count();
}

[[noreturn]] void raise(ErrorKind kind, const std::string& msg) {
  std::rethrow_exception(error_of(kind, msg));
}

// The group split, shrink or reconfigure formed; or its error, raised as the
// exception of its kind.
rust::Box<Group> formed(rust::Box<Formed> f) {
  if (f->failed()) raise(f->error_kind(), std::string(f->error_message()));
  return formed_group(std::move(f));
}

// f(), with the GIL let go where this thread holds it: what waits for other
// processes (a rendezvous, an op) lets Python threads run, and engine threads
// may need the GIL to finish futures while a group shuts down.
template <class F>
decltype(auto) without_gil(F&& f) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release nogil;
    return f();
  }
  return f();
}

// Whether `s` is being captured into a CUDA graph: torch's answer, or the
// driver's by the stream's native handle (torch before isStreamCapturing).
bool capturing(const c10::Stream& s) {
  if (auto known = compat::is_capturing(s)) return *known;
  try {
    return stream_capturing(reinterpret_cast<size_t>(s.native_handle()));
  } catch (const std::exception&) {
    return false;  // no native handle to ask about
  }
}

// dtype::complex_parts reads the complex types by these numbers.
static_assert(static_cast<int>(at::kComplexHalf) == 8 && static_cast<int>(at::kComplexFloat) == 9 &&
                  static_cast<int>(at::kComplexDouble) == 10,
              "torch's complex ScalarType numbers moved: update dtype::complex_parts");
static_assert(static_cast<int>(at::ScalarType::NumOptions) + static_cast<int>(DType::Opaque) < 255,
              "a dtype code of a type the engine only moves must fit below the call check's NONE");

DType dtype_of(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kChar: return DType::Int8;
    case at::kByte: return DType::UInt8;
    case at::kShort: return DType::Int16;
    case at::kInt: return DType::Int32;
    case at::kLong: return DType::Int64;
    case at::kBool: return DType::Bool;
    case at::kUInt16: return DType::UInt16;
    case at::kUInt32: return DType::UInt32;
    case at::kUInt64: return DType::UInt64;
    // A type the engine only moves: Opaque plus torch's ScalarType, so that
    // ranks passing complex64 and float8 still disagree (dtype::TypeCode).
    default: return static_cast<DType>(static_cast<uint8_t>(DType::Opaque) + static_cast<uint8_t>(type));
  }
}

TensorDesc desc_of(const at::Tensor& t) {
  return TensorDesc{reinterpret_cast<size_t>(t.data_ptr()), t.nbytes(), dtype_of(t.scalar_type())};
}

// `n` equal consecutive blocks of a contiguous tensor's storage.
std::vector<TensorDesc> split_desc(const TensorDesc& whole, size_t n, const char* op) {
  TORCH_CHECK(n > 0 && whole.nbytes % n == 0, "rustc10d: ", op, ": a tensor of ", whole.nbytes,
              " bytes does not split into ", n, " equal blocks");
  std::vector<TensorDesc> out;
  for (size_t i = 0; i < n; ++i) out.push_back(TensorDesc{whole.ptr + i * (whole.nbytes / n), whole.nbytes / n, whole.dtype});
  return out;
}

// Blocks of a contiguous tensor cut along dim 0 by `splits` (rows); empty: equal.
std::vector<TensorDesc> split_rows(const at::Tensor& t, const TensorDesc& whole, const std::vector<int64_t>& splits,
                                   size_t world, const char* op) {
  if (splits.empty()) {
    // Equal blocks of whole rows: blocks cut mid-row would be garbage.
    int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    TORCH_CHECK(rows % static_cast<int64_t>(world) == 0, "rustc10d: ", op, ": without split sizes, dim 0 (",
                rows, " rows) must divide into ", world, " equal blocks, one per rank");
    return split_desc(whole, world, op);
  }
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

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

rust::Vec<TensorDesc> rvec(const std::vector<TensorDesc>& v) {
  rust::Vec<TensorDesc> out;
  for (auto& d : v) out.push_back(d);
  return out;
}

// What a Work keeps of its op's Completion, which the engine owns (and may
// have finished and dropped by the time the Work is made).
struct WorkState {
  uint64_t key;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::vector<at::Tensor> outputs;
  std::shared_ptr<OpTiming> timing;
  std::shared_ptr<DeviceSync> cuda;
};

// The engine's op, as torch sees it.
class RustWork final : public compat::Work {
 public:
  RustWork(int rank, OpType type, rust::Box<Op> op, WorkState s)
      : compat::Work(rank, type, s.key),
        op_(std::move(op)),
        future_(std::move(s.future)),
        outputs_(std::move(s.outputs)),
        timing_(std::move(s.timing)),
        cuda_(std::move(s.cuda)) {}

  float getDuration() const override {
    float ms = timing_->duration_ms;
    TORCH_CHECK(ms >= 0, "rustc10d: getDuration(): the op has not completed successfully");
    return ms;
  }

  // A CUDA op is complete once its results are back on the device.
  bool isCompleted() override { return op_->is_done() && (!cuda_ || !isSuccess() || cuda_->landed()); }

  bool isSuccess() const override { return op_->is_done() && op_->error_message().empty(); }

  std::exception_ptr exception() const override {
    if (!op_->is_done() || op_->error_message().empty()) return nullptr;
    return error_of(op_->error_kind(), std::string(op_->error_message()));
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
  // does not (synchronize() does). Stream-ordered, the results were queued
  // at issue behind the op's gate (a send's: its copy to the host): the
  // caller's stream waits for them at once, and an error surfaces as
  // NCCL's do (the Work's exception, the group's next op), the tensors left
  // as they were; one already known is raised here, the stream ordered first
  // all the same (the held copies write the tensors' own bytes back).
  bool wait(milliseconds timeout = kNoTimeout) override {
    if (cuda_ && cuda_->stream_ordered()) {
      cuda_->order_after(c10::impl::getDeviceGuardImpl(cuda_->device.type())->getStream(cuda_->device));
      if (op_->is_done() && !op_->error_message().empty()) raise(op_->error_kind(), std::string(op_->error_message()));
      return true;
    }
    return host_wait(timeout);
  }

  void synchronize() override {
    host_wait(kNoTimeout);
    if (cuda_) cuda_->synchronize();
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  uint64_t getSequencenumber() const override { return op_->seq(); }

 private:
  bool host_wait(milliseconds timeout) {
    int64_t ms = timeout == kNoTimeout ? -1 : to_ms(timeout);
    switch (op_->wait(ms)) {
      case WaitOutcome::Done:
        if (cuda_) cuda_->done.block(c10::impl::getDeviceGuardImpl(cuda_->device.type())->getStream(cuda_->device));
        return true;
      case WaitOutcome::Failed:
        raise(op_->error_kind(), std::string(op_->error_message()));
      default:
        raise(ErrorKind::Timeout, c10::str("rustc10d: Timed out after ", ms, " ms in Work.wait; the ",
                                           c10d::opTypeToString(opType_), " op is still running"));
    }
  }

  rust::Box<Op> op_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<OpTiming> timing_;
  std::shared_ptr<DeviceSync> cuda_;
};

// One op's translation: its tensors become descriptors of host memory (CPU
// tensors as they are, or a contiguous copy; device tensors, and CPU tensors
// under test staging, a pinned host copy the engine stages), its results
// the future's value, and its options the Call.
class OpBuilder {
 public:
  // `results`: what the op's future and Work carry.
  OpBuilder(const char* op, OpKind kind, std::vector<at::Tensor> results, bool cuda_allowed, bool test_staging,
            bool stream_ordered)
      : op_(op), kind_(kind), cuda_allowed_(cuda_allowed), test_staging_(test_staging), stream_ordered_(stream_ordered) {
    call.kind = kind;
    call.root = -1;
    call.reduce = ReduceOpCode::Sum;
    call.timeout_ms = -1;
    done_ = std::make_unique<Completion>();
    done_->impl = std::make_unique<Completion::Impl>();
    done_->impl->outputs = std::move(results);
  }

  // input: read by the op; output: read and written in place; result: only
  // written, every byte of it (its old contents are never copied in).
  TensorDesc input(const at::Tensor& t) { return stage(t, Access::kRead); }
  TensorDesc output(const at::Tensor& t) { return stage(t, Access::kReadWrite); }
  TensorDesc result(const at::Tensor& t) { return stage(t, Access::kWrite); }
  template <typename Ts>
  std::vector<TensorDesc> inputs(const Ts& ts) { return stage_all(ts, Access::kRead); }
  template <typename Ts>
  std::vector<TensorDesc> results(const Ts& ts) { return stage_all(ts, Access::kWrite); }

  void reduce_op(const c10d::ReduceOp& op) {
    TORCH_CHECK(op.op_ <= c10d::ReduceOp::PREMUL_SUM, "rustc10d: ", op_, " does not support this reduce op");
    call.reduce = static_cast<ReduceOpCode>(op.op_);
    if (op.op_ == c10d::ReduceOp::PREMUL_SUM) {
      auto* s = dynamic_cast<compat::PreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(s, "rustc10d: ", op_, " got PREMUL_SUM without its factor");
      const at::Tensor& factor = s->tensor_factor;
      if (!factor.defined()) {
        call.premul = s->double_factor;
        return;
      }
      // Read here, once: of any floating dtype (NCCL wants the input's), on any device (one on
      // a GPU is read once the caller's current stream has made it: the call waits for that).
      TORCH_CHECK(factor.numel() == 1 && at::isFloatingType(factor.scalar_type()), "rustc10d: ", op_,
                  " does not support a PREMUL_SUM factor of dtype ", factor.scalar_type(), " and ",
                  factor.numel(), " element(s); pass one floating-point element, or a Python scalar");
      call.premul = factor.item<double>();
    }
  }

  Completion::Impl& impl() { return *done_->impl; }
  const char* name() const { return op_; }

  // The engine's half (`key` identifies it to completion hooks), and what
  // its Work keeps.
  std::pair<std::unique_ptr<Completion>, WorkState> finish(std::shared_ptr<compat::CompletionHooks> hooks,
                                                           uint64_t key) {
    auto& d = *done_->impl;
    // A CUDA future's value becomes usable on a stream only after the copies back.
    d.future = d.cuda ? c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(),
                                                                   std::vector<c10::Device>{d.cuda->device})
                      : c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    d.hooks = std::move(hooks);
    d.key = key;
    WorkState state{key, d.future, d.outputs, d.timing, d.cuda};
    return {std::move(done_), std::move(state)};
  }

  // Value-initialised: the fields an op does not set are zero or empty,
  // never indeterminate (Rust reads the whole struct).
  Call call{};

 private:
  enum class Access { kRead, kReadWrite, kWrite };

  // Where the torch side copies into or out of the caller's tensor (a
  // non-contiguous one's copy back, a staged one's), it works on a detached
  // alias: the same memory, without autograd, so that a parameter that
  // requires grad is written in place whatever the grad mode of the thread
  // that copies (the engine's, or the caller's outside torch.no_grad()).
  TensorDesc stage(const at::Tensor& user, Access access) {
    TORCH_CHECK(user.layout() == at::kStrided, "rustc10d: ", op_, " does not support ", user.layout(),
                " tensors; pass a dense (strided) tensor");
    const c10::Device device = user.device();
    TORCH_CHECK(device.is_cpu() || device.is_cuda(), "rustc10d: ", op_, " does not support tensors on ", device,
                "; pass CPU or CUDA tensors");
    if (!device_) device_ = device;
    TORCH_CHECK(device == *device_, "rustc10d: ", op_, " got tensors on ", *device_, " and on ", device,
                "; all tensors of one op must be on the same device");
    auto& d = *done_->impl;
    // A contiguous CPU tensor is the engine's as it lies: nothing copies into
    // it on the torch side, so it needs no detached alias (making one, a new
    // TensorImpl, was about half of this op's translation after idle).
    if (device.is_cpu() && !test_staging_ && user.is_contiguous()) {
      d.keep_alive.push_back(user);
      return desc_of(user);
    }
    const at::Tensor t = user.detach();
    if (device.is_cuda() || test_staging_) return stage_device(t, access);
    at::Tensor host = t.is_contiguous()           ? t
                      : access == Access::kWrite ? at::empty(t.sizes(), t.options())
                                                  : t.contiguous();
    d.keep_alive.push_back(host);
    if (access != Access::kRead && !host.is_same(t)) d.copy_back.emplace_back(t, host);
    return desc_of(host);
  }

  // A pinned host copy the engine works on, moved by its staging.
  TensorDesc stage_device(const at::Tensor& t, Access access) {  // t: detached (see stage)
    auto& d = *done_->impl;
    if (t.device().is_cuda()) {
      TORCH_CHECK(cuda_allowed_, "rustc10d: ", op_, " got a tensor on ", t.device(),
                  ", but CUDA tensors are turned off by RUSTC10D_CUDA=0; unset it to stage them through host memory");
      if (!d.cuda) {
        auto current = c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device());
        // Its tensors go through host memory on CPU threads, which a graph cannot replay.
        TORCH_CHECK(!capturing(current), "rustc10d: ", op_, " was called while the current stream of ",
                    t.device(), " is being captured into a CUDA graph, which rustc10d cannot take part in (it ",
                    "stages CUDA tensors through host memory on CPU threads); call it outside the capture");
        d.cuda = std::make_shared<DeviceSync>(t.device());
        d.cuda->ready.record(current);
        // Stream-ordered, a send's consumer may reuse its tensor once it is on the host.
        d.cuda->send_ordered = stream_ordered_ && kind_ == OpKind::Send;
      }
    }
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.device().is_cuda()));
    d.staged.push_back(Staged{t, host});
    auto desc = desc_of(host);
    call.staged.push_back(StagedDesc{desc, access != Access::kWrite, access != Access::kRead, t.is_contiguous()});
    return desc;
  }

  template <typename Ts>
  std::vector<TensorDesc> stage_all(const Ts& ts, Access access) {
    std::vector<TensorDesc> out;
    for (const auto& t : ts) out.push_back(stage(t, access));
    return out;
  }

  const char* op_;
  OpKind kind_;
  bool cuda_allowed_;
  bool test_staging_;
  bool stream_ordered_;
  std::optional<c10::Device> device_;
  std::unique_ptr<Completion> done_;
};

class RustBackend final : public compat::Backend<RustBackend> {
 public:
  RustBackend(rust::Box<Group> group, int rank, int size)
      : compat::Backend<RustBackend>(rank, size), membership_(group->membership()), group_(std::move(group)) {}

  // A backend made with enable_reconfigure: no group until reconfigure() forms one.
  RustBackend(rust::Box<Membership> membership, int rank, int size)
      : compat::Backend<RustBackend>(rank, size), membership_(std::move(membership)) {}

  ~RustBackend() override { stop(); }

  // destroy_process_group() and abort: fail what is pending, close sockets, join threads.
  void shutdown() override { stop(); }
  // The abort hooks run first: torch 2.15's flight recorder registers one
  // that writes its trace to disk (about 2 s here), which is why they run
  // when the group is aborted and not where each op fails, whose error
  // would wait for it.
  void abort() override {
    abort_hooks_->fire();
    stop();
  }
  bool stopped() const { return stopped_.load(); }

  // What broke the group, as torch's ErrorType's value: a timeout; a peer
  // lost, or that gave up on the group (an error that came from another
  // rank); anything else; 0 while nothing has (a failed point-to-point op
  // leaves the group usable, and says nothing here).
  int error_type() const {
    if (!group_) return 0;
    auto broken = (*group_)->broken_by();
    if (!broken.broken) return 0;
    switch (broken.kind) {
      case ErrorKind::Timeout: return 1;
      case ErrorKind::PeerLost: return 3;
      default: return 2;
    }
  }

  const std::string getBackendName() const override { return "rustc10d"; }
  bool supportsCoalescing() const override { return true; }
  bool supportsSplitting() const override { return true; }

  // What torch's split_group hands the child when the caller gives no options.
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>(getBackendName(), milliseconds(membership_->timeout_ms()));
  }

  // torch names the group after making it; Python asks about it by that name.
  void setGroupUid(const std::string& pg_uid) override {
    compat::Backend<RustBackend>::setGroupUid(pg_uid);
    if (group_) (*group_)->watch_as(pg_uid);
  }

  bool supportsShrinking() const override { return true; }

  // The survivors' group: every rank of this one but `ranks_to_exclude`,
  // through this group's Store. SHRINK_ABORT (1) first fails what is still
  // pending here; torch destroys this group afterwards either way.
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                                           const c10::intrusive_ptr<Options>& opts_override) override {
    if (shrink_flags & 1) stop();
    const int64_t timeout = opts_override ? to_ms(opts_override->timeout) : membership_->timeout_ms();
    rust::Slice<const int64_t> excluded(ranks_to_exclude.data(), ranks_to_exclude.size());
    auto join = [&] { return group().shrink(excluded, timeout); };
    auto make = [](rust::Box<Group> child) {
      const int rank = child->rank(), size = child->size();
      return c10::make_intrusive<RustBackend>(std::move(child), rank, size);
    };
    return without_gil([&] { return make(formed(join())); });
  }

  // A child of the parent ranks `ranks` (in their order), with this group's
  // settings (on this group's connections where it can share them, else
  // through the Store torch namespaced for it); nullptr on a rank outside
  // it, as torch expects of a non-member.
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    auto me = std::find(ranks.begin(), ranks.end(), getRank());
    if (me == ranks.end()) return nullptr;
    const int rank = static_cast<int>(me - ranks.begin()), size = static_cast<int>(ranks.size());
    const int64_t timeout = opts ? to_ms(opts->timeout) : membership_->timeout_ms();
    const std::string name = opts ? opts->group_name : std::string();
    // torch before 2.15 splits once per device type, and this backend serves
    // CPU and CUDA: the second device's split of a group is the first's child.
    if (auto last = last_split_.lock(); last && !name.empty() && last_split_name_ == name) return last;
    rust::Slice<const int32_t> members(ranks.data(), ranks.size());
    auto join = [&] { return group().split(store_ref_of(store), members, rank, size, timeout, name); };
    c10::intrusive_ptr<c10d::Backend> child =
        without_gil([&] { return c10::make_intrusive<RustBackend>(formed(join()), rank, size); });
    last_split_name_ = name;
    last_split_ = c10::weak_intrusive_ptr<c10d::Backend>(child);
    return child;
  }
  uint64_t getSequenceNumberForGroup() override { return group_ ? (*group_)->sequence_number() : 0; }
  void setSequenceNumberForGroup() override {}  // starts at 0 on every rank
  void setTimeout(milliseconds timeout) override {
    membership_->set_timeout(to_ms(timeout));
    if (group_) (*group_)->set_timeout(to_ms(timeout));
  }

  // This backend's reconfigure handle for now: see src/membership.rs.
  std::string reconfigure_handle() const { return std::string(membership_->reconfigure_handle(getRank())); }

  // The group re-formed of the processes whose handles are `handles`, from
  // the Store under a namespace of `uuid`'s own (every member calls it with
  // the same handles and uuid). On success, this backend's last group is shut
  // down (what was pending on it fails) and the new one takes its place, rank
  // and size (the new ones returned); on a failure, nothing changes. As with torch's other backends,
  // no op of this group may be issued meanwhile on another thread.
  std::pair<int, int> reconfigure_to(const std::vector<std::string>& handles, bool ordered, int64_t uuid,
                                     int64_t timeout_ms) {
    rust::Vec<rust::String> given;
    for (const auto& h : handles) given.push_back(rust::String(h));
    try {
      membership_->check_handles(getRank(), given, ordered);
    } catch (const rust::Error& e) {
      raise(ErrorKind::InvalidArgument, e.what());
    }
    auto form = [&] {
      return membership_->reconfigure(getRank(), uuid, std::move(given), ordered, timeout_ms, getGroupUid());
    };
    rust::Box<Group> group = formed(without_gil(form));
    stop();
    group_ = std::move(group);
    return {(*group_)->rank(), (*group_)->size()};
  }

  // Every op issued until endCoalescing() is waited for by its Work.
  void startCoalescing() override {
    try {
      group().start_coalescing();
    } catch (const rust::Error& e) {
      throw c10::Error(here(__func__), e.what());
    }
    coalescing_ = true;
    coalesced_.clear();
    coalesced_syncs_.clear();
  }

  // A batch of CUDA ops. Stream-ordered, its ops were each ordered at issue
  // and its Work orders the caller's stream after every one of them.
  // Else its Work orders the caller's stream after every op's copies back,
  // which their completions queued on rustc10d's stream before the batch
  // completes.
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    coalescing_ = false;
    auto b = builder("coalesced", OpKind::Barrier, std::move(coalesced_));
    auto syncs = std::move(coalesced_syncs_);
    for (const auto& sync : syncs) {
      if (!sync->stream_ordered()) continue;
      auto& batch = b.impl().cuda;
      if (!batch) batch = std::make_shared<DeviceSync>(sync->device);
      if (!batch->side) batch->side = sync->side;
      batch->members.push_back(sync);
    }
    for (const auto& t : b.impl().outputs) {
      if (b.impl().cuda) break;
      if (t.defined() && t.device().is_cuda()) b.impl().cuda = std::make_shared<DeviceSync>(t.device());
    }
    auto [done, state] = b.finish(hooks_, next_key_++);
    return work(OpType::COALESCED, group().end_coalescing(std::move(done)), std::move(state));
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

  // SUM of sparse COO tensors: the engine gathers every rank's rows, torch adds them up.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    auto& t = single(tensors, "allreduce_sparse");
    TORCH_CHECK(t.layout() == at::kSparse && t.device().is_cpu(),
                "rustc10d: allreduce_sparse takes a sparse COO tensor on the CPU");
    TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "rustc10d: allreduce on sparse tensors supports SUM only");
    // Each rank sends its rows coalesced (DDP's sparse gradients are not), so
    // that a peer's row count is bounded by the tensor's shape.
    at::NoGradGuard no_grad;
    auto input = t.coalesce();
    auto indices = input.indices().t().contiguous();  // [nnz, sparse_dim]
    auto values = input.values().contiguous();         // [nnz, dense...]
    auto b = builder("allreduce_sparse", OpKind::AllReduceSparse, {t});
    b.impl().sparse = t;
    b.call.inputs = rvec({b.input(indices), b.input(values)});
    for (auto size : t.sizes()) b.call.sparse_sizes.push_back(size);
    b.call.sparse_dim = static_cast<size_t>(input.sparse_dim());
    int64_t per_row = 1;
    for (int64_t d = 1; d < values.dim(); ++d) per_row *= values.size(d);
    b.call.value_row = static_cast<size_t>(per_row * values.element_size());
    b.call.timeout_ms = to_ms(opts.timeout);
    b.call.sync_op = !opts.asyncOp;
    return submit(b, OpType::_ALLREDUCE_SPARSE);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    auto& t = single(tensors, "reduce");
    auto b = builder("reduce", OpKind::Reduce, {t});
    b.call.outputs = rvec({b.output(t)});
    b.reduce_op(opts.reduceOp);
    return rooted(b, opts, OpType::REDUCE);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto& t = single(tensors, "broadcast");
    auto b = builder("broadcast", OpKind::Broadcast, {t});
    b.call.outputs = rvec({b.output(t)});
    return rooted(b, opts, OpType::BROADCAST);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    auto& in = single(inputs, "allgather");
    TORCH_CHECK(outputs.size() == 1, "rustc10d: allgather takes one output list, got ", outputs.size());
    auto b = builder("allgather", OpKind::AllGather, outputs[0]);
    b.call.inputs = rvec({b.input(in)});
    b.call.outputs = rvec(b.results(outputs[0]));
    return timed(b, opts, OpType::ALLGATHER);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    auto b = builder("all_gather_into_tensor", OpKind::AllGather, {output});
    b.call.inputs = rvec({b.input(input)});
    b.call.outputs = rvec(split_desc(b.result(output), getSize(), b.name()));
    return timed(b, opts, OpType::_ALLGATHER_BASE);
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
    auto b = builder("allgather_coalesced", OpKind::AllGather, flatten(outputs));
    b.call.inputs = rvec(b.inputs(inputs));
    b.call.outputs = rvec(b.results(by_input));
    return timed(b, opts, OpType::ALLGATHER_COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    auto b = builder("allgather_into_tensor_coalesced", OpKind::AllGather, outputs);
    b.call.inputs = rvec(b.inputs(inputs));
    std::vector<TensorDesc> os;
    for (auto& o : outputs) {
      auto blocks = split_desc(b.result(o), getSize(), b.name());
      os.insert(os.end(), blocks.begin(), blocks.end());
    }
    b.call.outputs = rvec(os);
    return timed(b, opts, compat::kAllgatherIntoTensorCoalesced);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    auto& in = single(inputs, "gather");
    bool root = opts.rootRank == getRank();
    auto results = root && !outputs.empty() ? outputs[0] : std::vector<at::Tensor>{};
    auto b = builder("gather", OpKind::Gather, results);
    b.call.inputs = rvec({b.input(in)});
    b.call.outputs = rvec(b.results(results));
    return rooted(b, opts, OpType::GATHER);
  }

  // torch's gather_into_tensor, where it has one (see compat::Backend).
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts) {
    bool root = opts.rootRank == getRank();
    auto b = builder("gather_into_tensor", OpKind::Gather, root ? std::vector<at::Tensor>{output} : std::vector<at::Tensor>{});
    b.call.inputs = rvec({b.input(input)});
    if (root) b.call.outputs = rvec(split_desc(b.result(output), getSize(), b.name()));
    return rooted(b, opts, OpType::GATHER);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    auto& out = single(outputs, "scatter");
    bool root = opts.rootRank == getRank();
    auto b = builder("scatter", OpKind::Scatter, {out});
    if (root && !inputs.empty()) b.call.inputs = rvec(b.inputs(inputs[0]));
    b.call.outputs = rvec({b.result(out)});
    return rooted(b, opts, OpType::SCATTER);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto& out = single(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1, "rustc10d: reduce_scatter takes one input list, got ", inputs.size());
    auto b = builder("reduce_scatter", OpKind::ReduceScatter, {out});
    b.call.inputs = rvec(b.inputs(inputs[0]));
    b.call.outputs = rvec({b.result(out)});
    b.reduce_op(opts.reduceOp);
    return timed(b, opts, OpType::REDUCE_SCATTER);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    auto b = builder("reduce_scatter_tensor", OpKind::ReduceScatter, {output});
    b.call.inputs = rvec(split_desc(b.input(input), getSize(), b.name()));
    b.call.outputs = rvec({b.result(output)});
    b.reduce_op(opts.reduceOp);
    return timed(b, opts, OpType::_REDUCE_SCATTER_BASE);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    auto b = builder("reduce_scatter_tensor_coalesced", OpKind::ReduceScatter, outputs);
    std::vector<TensorDesc> is;
    for (auto& i : inputs) {
      auto blocks = split_desc(b.input(i), getSize(), b.name());
      is.insert(is.end(), blocks.begin(), blocks.end());
    }
    b.call.inputs = rvec(is);
    b.call.outputs = rvec(b.results(outputs));
    b.reduce_op(opts.reduceOp);
    return timed(b, opts, compat::kReduceScatterTensorCoalesced);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override {
    auto b = builder("all_to_all_single", OpKind::AllToAll, {output});
    size_t w = getSize();
    b.call.inputs = rvec(split_rows(input, b.input(input), inputSplits, w, b.name()));
    b.call.outputs = rvec(split_rows(output, b.result(output), outputSplits, w, b.name()));
    return timed(b, opts, OpType::ALLTOALL_BASE);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    auto b = builder("all_to_all", OpKind::AllToAll, outputs);
    b.call.inputs = rvec(b.inputs(inputs));
    b.call.outputs = rvec(b.results(outputs));
    return timed(b, opts, OpType::ALLTOALL);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    auto b = builder("barrier", OpKind::Barrier, {});
    return timed(b, opts, OpType::BARRIER);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    auto b = builder("monitored_barrier", OpKind::MonitoredBarrier, {});
    b.call.wait_all = waitAllRanks;
    timed(b, opts, OpType::BARRIER)->wait();
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto& t = single(tensors, "send");
    auto b = builder("send", OpKind::Send, {t});
    b.call.inputs = rvec({b.input(t)});
    return p2p(b, dst, tag, OpType::SEND);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto& t = single(tensors, "recv");
    auto b = builder("recv", OpKind::Recv, {t});
    b.call.outputs = rvec({b.result(t)});
    return p2p(b, src, tag, OpType::RECV);
  }

  // rustc10d.all_reduce_ (direct_all_reduce, below): a contiguous CPU tensor reduced in
  // place, on the caller's thread where the group is idle, with no Work, no
  // future and no copy; any other tensor takes allreduce()'s way. Returns
  // once the result is there (or raises).
  void all_reduce_now(at::Tensor& t, int64_t op) {
    TORCH_CHECK(op >= 0 && op < static_cast<int64_t>(c10d::ReduceOp::PREMUL_SUM),
                "rustc10d.all_reduce_: reduce op ", op, " is not one of SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR");
    if (!t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous() || membership_->test_staging()) {
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
      opts.asyncOp = false;
      std::vector<at::Tensor> tensors{t};
      allreduce(tensors, opts)->wait();
      return;
    }
    auto ended = group().all_reduce_direct(desc_of(t), static_cast<ReduceOpCode>(op));
    if (ended.failed) raise(ended.kind, std::string(ended.message));
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    auto& t = single(tensors, "recv");
    auto b = builder("recv", OpKind::Recv, {t});
    b.call.outputs = rvec({b.result(t)});
    return p2p(b, -1, tag, OpType::RECVANYSOURCE);
  }

 private:
  static at::Tensor& single(std::vector<at::Tensor>& tensors, const char* op) {
    TORCH_CHECK(tensors.size() == 1, "rustc10d: ", op, " takes exactly one tensor, got ", tensors.size());
    return tensors[0];
  }

  OpBuilder builder(const char* op, OpKind kind, std::vector<at::Tensor> results) {
    group();  // refuses before anything is staged on a backend not formed yet
    return OpBuilder(op, kind, std::move(results), membership_->cuda_allowed(), membership_->test_staging(),
                     membership_->stream_ordered());
  }

  // One collective per tensor, one Work for all of them.
  c10::intrusive_ptr<c10d::Work> dense_allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts,
                                                 const char* name, OpType type) {
    auto b = builder(name, OpKind::AllReduce, tensors);
    std::vector<TensorDesc> ds;
    for (auto& t : tensors) ds.push_back(b.output(t));
    b.call.outputs = rvec(ds);
    b.reduce_op(opts.reduceOp);
    return timed(b, opts, type);
  }

  // A collective with torch's options: its timeout, and whether its caller
  // waits for it at once (async_op=False), which lets the engine run it on
  // the caller's thread.
  template <typename Options>
  c10::intrusive_ptr<c10d::Work> timed(OpBuilder& b, const Options& opts, OpType type) {
    b.call.timeout_ms = to_ms(opts.timeout);
    b.call.sync_op = !opts.asyncOp;
    return submit(b, type);
  }

  template <typename Options>
  c10::intrusive_ptr<c10d::Work> rooted(OpBuilder& b, const Options& opts, OpType type) {
    b.call.root = opts.rootRank;
    return timed(b, opts, type);
  }

  c10::intrusive_ptr<c10d::Work> p2p(OpBuilder& b, int peer, int tag, OpType type) {
    b.call.root = peer;
    b.call.tag = tag;
    return submit(b, type);
  }

  // Hand the call to the engine; an op refused at once raises here.
  c10::intrusive_ptr<c10d::Work> submit(OpBuilder& b, OpType type) {
    auto call = std::move(b.call);
    if (coalescing_) coalesced_.insert(coalesced_.end(), b.impl().outputs.begin(), b.impl().outputs.end());
    auto [done, state] = b.finish(hooks_, next_key_++);
    if (coalescing_ && state.cuda) coalesced_syncs_.push_back(state.cuda);
    return work(type, group().submit(call, std::move(done)), std::move(state));
  }

  c10::intrusive_ptr<c10d::Work> work(OpType type, rust::Box<Op> op, WorkState state) {
    if (op->failed_at_issue()) raise(op->error_kind(), std::string(op->error_message()));
    return c10::make_intrusive<RustWork>(getRank(), type, std::move(op), std::move(state));
  }

  void stop() {
    stopped_.store(true);
    if (group_) without_gil([&] { (*group_)->shutdown(); });
  }

  // The group ops run on; a backend made with enable_reconfigure has none
  // until its first reconfigure.
  const Group& group() const {
    TORCH_CHECK(group_, "rustc10d: this process group was made with enable_reconfigure=True (or by "
                        "rustc10d.reconfigurable_group) and has no members yet: reconfigure it on every process "
                        "first (torch.distributed._reconfigure(uuid, handles), or ProcessGroup.reconfigure, which "
                        "torchft's Manager calls at each quorum)");
    return **group_;
  }

  rust::Box<Membership> membership_;
  std::optional<rust::Box<Group>> group_;
  // The last child split off and its group name, held weakly: see split().
  std::string last_split_name_;
  c10::weak_intrusive_ptr<c10d::Backend> last_split_{c10::intrusive_ptr<c10d::Backend>()};
  std::atomic<uint64_t> next_key_{1};
  std::atomic<bool> stopped_{false};  // shut down, aborted or destroyed: see direct_all_reduce's cache
  bool coalescing_ = false;
  std::vector<at::Tensor> coalesced_;  // the results of the ops issued while coalescing
  std::vector<std::shared_ptr<DeviceSync>> coalesced_syncs_;  // and their CUDA side
};

// The group this thread's last direct op ran on. A caller makes them in a
// loop on one group (two per layer per token), and torch's registry of groups
// (a string hashed, a map under a lock) cost about 0.5 us of a small op's 5
// after an idle spell (cold caches). Held weakly, as torch's registry holds
// it: a group's last reference going releases its backends at once. Used
// while the group lives and its backend was not shut down:
// destroy_process_group shuts down the backends of every group it
// unregisters, so a name used again, for a new group, is looked up afresh.
struct LastGroup {
  std::string name;
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group{c10::intrusive_ptr<c10d::ProcessGroup>()};
};
thread_local LastGroup last_group;

// The backend of group `group_name` for `device`'s tensors, which must be rustc10d's.
c10::intrusive_ptr<c10d::Backend> backend_for(c10::string_view group_name, c10::DeviceType device) {
  auto& last = last_group;
  if (c10::string_view(last.name) == group_name) {
    if (auto group = last.group.lock()) {
      auto backend = group->getBackend(device);
      auto* ours = dynamic_cast<RustBackend*>(backend.get());
      if (ours && !ours->stopped()) return backend;
    }
  }
  auto group = c10d::resolve_process_group(std::string(group_name));
  auto backend = group->getBackend(device);
  TORCH_CHECK(dynamic_cast<RustBackend*>(backend.get()), "rustc10d.all_reduce_: the backend of group ", group_name,
              " for ", device, " tensors is ", backend->getBackendName(), ", not rustc10d");
  last = LastGroup{std::string(group_name), c10::weak_intrusive_ptr<c10d::ProcessGroup>(group)};
  return backend;
}

}  // namespace

// rustc10d::all_reduce_(Tensor(a!) tensor, str group_name, int op=0): for
// callers that make many small all_reduces (tensor-parallel inference) and
// want no more than one dispatcher call each, as DeepSpeed's shm op is. The
// GIL is let go while the op waits, as torch.distributed's calls do.
at::Tensor& direct_all_reduce(at::Tensor& tensor, c10::string_view group_name, int64_t op) {
  auto backend = backend_for(group_name, tensor.device().type());
  auto* ours = static_cast<RustBackend*>(backend.get());  // backend_for checked it
  without_gil([&] { ours->all_reduce_now(tensor, op); });
  return tensor;
}

TORCH_LIBRARY(rustc10d, m) {
  m.def("all_reduce_(Tensor(a!) tensor, str group_name, int op=0) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(rustc10d, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_", direct_all_reduce);
}

namespace {

// The holder torch's own backends have in Python: an intrusive_ptr that lets
// go of the GIL when it drops the last reference (a backend's destructor joins
// threads that may need the GIL). Out-of-tree backends copy it, as torch does
// not export it; pybind reads it as the intrusive_ptr it holds.
template <typename T>
class NoGilHolder {
 public:
  NoGilHolder() = default;
  NoGilHolder(const NoGilHolder&) = default;
  explicit NoGilHolder(T* impl) : impl_(c10::intrusive_ptr<T>::unsafe_steal_from_new(impl)) {}
  ~NoGilHolder() {
    if (impl_ && Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      impl_.reset();
    }
  }
  T& operator*() const noexcept { return *impl_; }
  T* operator->() const noexcept { return impl_.get(); }
  T* get() const noexcept { return impl_.get(); }

 private:
  c10::intrusive_ptr<T> impl_;
};

}  // namespace
}  // namespace rustc10d

PYBIND11_DECLARE_HOLDER_TYPE(T, rustc10d::NoGilHolder<T>, true)

namespace rustc10d {

// rustc10d.all_reducer(op, group)'s callable: all_reduce_'s op bound once to
// a backend and a reduce op, called with the tensor alone. Called from Python
// it skips the dispatcher: torch.ops turns each argument into an IValue and
// runs the autograd and in-place fallbacks over them, which after an idle
// spell (cold caches) took 14-18 us of the op's 23-28 at W=2, 8 bytes, about
// 2 us more for each argument beyond the tensor. What it does with a tensor is
// the op's: all_reduce_now (the caller's thread where the group is idle), in
// place; a tensor that requires grad is taken as the op takes it.
class AllReducer {
 public:
  AllReducer(py::object backend, int64_t op) : owner_(std::move(backend)), op_(op) {
    TORCH_CHECK(py::isinstance<RustBackend>(owner_), "rustc10d.all_reducer: not a rustc10d backend");
    TORCH_CHECK(op >= 0 && op < static_cast<int64_t>(c10d::ReduceOp::PREMUL_SUM), "rustc10d.all_reducer: reduce op ",
                op, " is not one of SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR");
    backend_ = owner_.cast<RustBackend*>();
  }

  at::Tensor operator()(at::Tensor tensor) const {
    without_gil([&] { backend_->all_reduce_now(tensor, op_); });
    return tensor;
  }

 private:
  // Keeps the backend alive; when it goes, with the GIL held, the backend's
  // holder lets go of the GIL for its destructor (NoGilHolder).
  py::object owner_;
  RustBackend* backend_;
  int64_t op_;
};

// Our backend's Python class, a torch Backend with what torch's Python calls
// on backends that support splitting and the base class lacks: a new_group
// whose members split from a bound device has its non-members call
// perform_nocolor_split, which has nothing to do here (a child joins through
// the Store). Registered once, in the package (rustc10d._Backend).
void register_python_class() {
  static bool registered = [] {
    py::module_::import("torch._C._distributed_c10d");  // registers c10d::Backend, our base
    py::class_<RustBackend, c10d::Backend, NoGilHolder<RustBackend>>(py::module_::import("rustc10d"), "_Backend")
        .def(
            "perform_nocolor_split", [](RustBackend&, const at::Device&) {},
            "A rank outside a new group split from a bound device: nothing to do.");
    py::class_<AllReducer>(py::module_::import("rustc10d"), "_AllReducer")
        .def(py::init<py::object, int64_t>(), py::arg("backend"), py::arg("op"))
        .def("__call__", &AllReducer::operator(), py::arg("tensor"),
             "All-reduce `tensor` in place over the bound group, with the bound op; returns it.");
    return true;
  }();
  (void)registered;
}

size_t backend_to_python(rust::Box<Group> group, int32_t rank, int32_t size) {
  register_python_class();
  c10::intrusive_ptr<c10d::Backend> backend = c10::make_intrusive<RustBackend>(std::move(group), rank, size);
  return reinterpret_cast<size_t>(py::cast(backend).release().ptr());
}

size_t unformed_backend_to_python(rust::Box<Membership> membership, int32_t rank, int32_t size) {
  register_python_class();
  c10::intrusive_ptr<c10d::Backend> backend = c10::make_intrusive<RustBackend>(std::move(membership), rank, size);
  return reinterpret_cast<size_t>(py::cast(backend).release().ptr());
}

}  // namespace rustc10d

// Which torch this shim was built against, and which of the torch APIs that differ across
// releases it found there (build_shim.py): the package reads them when it loads the shim.
extern "C" __attribute__((visibility("default"))) const char* rustc10d_shim_torch_version() {
  return RUSTC10D_SHIM_TORCH_VERSION;
}
extern "C" __attribute__((visibility("default"))) const char* rustc10d_shim_torch_features() {
  return RUSTC10D_SHIM_TORCH_FEATURES;
}
