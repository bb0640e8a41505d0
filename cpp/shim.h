// The C++ side of the cxx bridge. Kept free of torch headers: the generated
// bridge code includes it, and torch headers cost seconds per translation unit.
#pragma once
#include <cstdint>
#include <memory>
#include "rust/cxx.h"

namespace rustc10d {

struct Group;  // Rust: the engine of one process group

// A c10d::Store handed over by torch.
struct StoreRef {
  struct Impl;
  std::unique_ptr<Impl> impl;
  ~StoreRef();
};

// What finishing an op means on the torch side: copy staged results back,
// complete the Work's future, release the tensors. Owned by the engine.
struct Completion {
  struct Impl;
  std::unique_ptr<Impl> impl;
  ~Completion();
};

void store_set(const StoreRef& store, rust::Str key, rust::Slice<const uint8_t> value);
rust::Vec<uint8_t> store_get(const StoreRef& store, rust::Str key, int64_t timeout_ms);
int64_t store_add(const StoreRef& store, rust::Str key, int64_t delta);
rust::String store_host(const StoreRef& store);
std::unique_ptr<StoreRef> store_from_python(size_t pyobject);

void complete(std::unique_ptr<Completion> done, rust::Str error) noexcept;
void stage_inputs(const Completion& done);
bool stage_pieces(const Completion& done, size_t bytes);
void piece_in(const Completion& done, size_t i);
void piece_out(const Completion& done, size_t i);
void await_staged(const Completion& done);

// Wrap the engine in a c10d::Backend and return a new reference to its Python object.
size_t backend_to_python(rust::Box<Group> group, int32_t rank, int32_t size);

}  // namespace rustc10d
