//! Panics are contained on every thread the library runs or borrows: a bug
//! must fail the op it hit (and break the groups it touched), never stall
//! every group behind a dead thread, nor abort the process by unwinding into
//! C++ (cxx aborts on a panic that reaches its boundary).

use crate::error::Error;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What a panic said.
pub fn why(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Run `f`; a panic comes back as an error saying `what` hit it. The
/// state `f` touched may be half-updated: callers fail (or break) what it
/// belongs to rather than use it again as if nothing happened.
pub fn contain<T>(what: impl std::fmt::Display, f: impl FnOnce() -> T) -> Result<T, Error> {
    catch_unwind(AssertUnwindSafe(f))
        .map_err(|panic| Error::io(format!("rustc10d: {what} hit an internal error: {}", why(&*panic))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_naming_what_hit_it() {
        assert_eq!(contain("allreduce #3 on rank 1", || 7).unwrap(), 7);
        let e = contain("allreduce #3 on rank 1", || -> () { panic!("index out of bounds") }).unwrap_err();
        assert_eq!(e.message, "rustc10d: allreduce #3 on rank 1 hit an internal error: index out of bounds");
        let n = 4;
        let e = contain("the I/O thread", || -> () { panic!("{n} frames") }).unwrap_err();
        assert!(e.message.ends_with("4 frames"), "{}", e.message);
    }
}
