// The C++ side of the cxx bridge. Kept free of torch headers: the generated
// bridge code includes it, and torch headers cost seconds per translation unit.
#pragma once
#include <cstdint>
#include <memory>
#include "rust/cxx.h"

namespace rustc10d {

struct Group;       // Rust: the engine of one process group
struct Membership;  // Rust: what a backend keeps to re-form its group (reconfigure)
enum class ErrorKind : uint8_t;

// A c10d::Store handed over by torch.
struct StoreRef {
  struct Impl;
  std::unique_ptr<Impl> impl;
  ~StoreRef();
};

// What finishing an op means on the torch side (complete its future), and its
// staged tensors' device side. Owned by the engine, which drops it (and
// with it the op's tensors) once nothing of the op uses it.
struct Completion {
  struct Impl;
  std::unique_ptr<Impl> impl;
  ~Completion();
};

void store_set(const StoreRef& store, rust::Str key, rust::Slice<const uint8_t> value);
rust::Vec<uint8_t> store_get(const StoreRef& store, rust::Str key, int64_t timeout_ms);
int64_t store_add(const StoreRef& store, rust::Str key, int64_t delta);
bool store_delete(const StoreRef& store, rust::Str key);
rust::String store_host(const StoreRef& store);
std::unique_ptr<StoreRef> store_clone(const StoreRef& store);
std::unique_ptr<StoreRef> store_from_python(size_t pyobject);

rust::String settle(const Completion& done) noexcept;
rust::String settle_sparse(const Completion& done, rust::Slice<const uint64_t> rows,
                           rust::Slice<const uint8_t> indices, rust::Slice<const uint8_t> values) noexcept;
void publish(const Completion& done, ErrorKind kind, rust::Str error) noexcept;

// Device primitives (see src/engine/staging.rs).
uint64_t to_host(const Completion& done, size_t buffer, size_t start, size_t len);
void wait_event(const Completion& done, uint64_t event);
void to_device(const Completion& done, size_t buffer, size_t start, size_t len);
int32_t staged_device(const Completion& done);
void to_device_held(const Completion& done, size_t held, size_t side, size_t buffer, size_t start, size_t len);
void restore(const Completion& done, size_t restore_stream, size_t buffer, size_t start, size_t len);

// Wrap the engine in a c10d::Backend and return a new reference to its Python object.
size_t backend_to_python(rust::Box<Group> group, int32_t rank, int32_t size);
// The same for a backend made with enable_reconfigure: no group until its first reconfigure.
size_t unformed_backend_to_python(rust::Box<Membership> membership, int32_t rank, int32_t size);

}  // namespace rustc10d
