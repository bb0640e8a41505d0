// What keeps the shim within manylinux_2_28 (glibc 2.28), the oldest glibc torch's own wheels run
// on, when it is compiled on a newer one.
//
// libstdc++'s headers (GCC 11 on, where glibc 2.32+ has <sys/single_threaded.h>) read glibc's
// __libc_single_threaded to skip the atomic part of reference counts (shared_ptr, std::string's
// facets) while a process has one thread. That one read would make the shim need glibc 2.32. This
// definition, hidden (the shim's reads bind to it, nothing outside sees it), always says "threads
// may exist", so every count stays atomic, as it is on an older glibc; and the shim runs in
// processes that have threads anyway (torch's and the engine's).
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}
