//! Memory the allocator may refuse: a size that a peer's counts decide (the
//! sparse all-reduce's gathered rows) fails the op when it cannot be had,
//! where `vec!` would abort the process.

#![deny(clippy::undocumented_unsafe_blocks)]

/// `bytes` zeroed bytes, or None if the allocator refuses them. Zeroed by
/// the allocator as `vec!` does it (pages that are never written are never
/// touched), but without aborting the process when they cannot be had.
pub fn zeroed(bytes: usize) -> Option<Vec<u8>> {
    if bytes == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(bytes).ok()?;
    // SAFETY: `layout` has a size above zero (checked above), as alloc_zeroed requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` comes from the global allocator with `layout`: `bytes`
    // bytes at alignment 1, a u8's, all zero (so initialised); length and
    // capacity are both that size, as from_raw_parts requires.
    Some(unsafe { Vec::from_raw_parts(ptr, bytes, bytes) })
}
