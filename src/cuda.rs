//! The CUDA driver, loaded at run time through cudarc (dynamic loading: the
//! library builds and imports without a CUDA toolkit or driver), and only
//! what stream-ordered completion needs from it: streams of our own, a word
//! of mapped pinned host memory the engine writes, and a stream's wait for
//! that word. Copies and events stay with torch (the shim), which already
//! orders them against the caller's streams.
//!
//! Every call runs with the device's primary context pushed (the one torch
//! uses), so it does not matter which thread calls or what it had current.
//!
//! cudarc's driver functions are raw C calls: each is unsafe, and each call
//! says which of the driver's rules it keeps (valid handles, a current
//! context, out-pointers to live locals).

#![deny(clippy::undocumented_unsafe_blocks)]

use crate::error::{Error, Result};
use crate::locks::{level, Mutex};
use cudarc::driver::sys as cu;
use std::ffi::CStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The driver entry points used here: all must resolve before any is called
/// (cudarc panics on a missing one).
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuStreamCreate",
    "cuStreamQuery",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuStreamWaitValue32_v2",
    "cuStreamIsCapturing",
    "cuGetErrorName",
];

/// Whether the driver can be used here: loaded once, with every symbol
/// above; else why not, in words.
pub fn available() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        // SAFETY: loading a library runs its initialisers; libcuda's are the
        // driver's own, which expect nothing of the loading process.
        if !unsafe { cu::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so) could not be loaded".into());
        }
        // SAFETY: as above; it is present, so cudarc loads it (and keeps it
        // loaded for the process, behind the 'static reference) instead of panicking.
        let lib = unsafe { cu::culib() };
        let missing: Vec<&str> = SYMBOLS
            .iter()
            .copied()
            // SAFETY: the symbol is only looked up, never called, so the
            // function type given for it does not matter.
            .filter(|s| unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err())
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "the CUDA driver lacks {} (a driver for CUDA 12 or newer is needed)",
                missing.join(", ")
            ));
        }
        // SAFETY: every symbol resolved (cudarc would panic on a missing one);
        // cuInit takes flags only, 0 the one value allowed, and may be called
        // from any thread, any number of times.
        check(unsafe { cu::cuInit(0) }, "cuInit")
    });
    loaded.clone().map_err(|why| Error::unsupported(format!("rustc10d: stream-ordered completion: {why}")))
}

fn check(r: cu::CUresult, what: &str) -> std::result::Result<(), String> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: reached only once `available` resolved the symbol (the
    // loader's own errors are checked before); `name` is a live local the
    // driver writes a pointer into, and the driver accepts any code.
    let named = unsafe { cu::cuGetErrorName(r, &mut name) } == cu::CUresult::CUDA_SUCCESS && !name.is_null();
    let name = if named {
        // SAFETY: on success the driver points `name` at a static NUL-terminated string.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    };
    Err(format!("{what} failed: {name}"))
}

fn driver(r: cu::CUresult, what: &str) -> Result<()> {
    check(r, what).map_err(|why| Error::io(format!("rustc10d: CUDA driver: {why}")))
}

/// A device's primary context, made current on this thread while `f` runs.
fn in_context<T>(ctx: Context, f: impl FnOnce() -> Result<T>) -> Result<T> {
    // SAFETY: `ctx` is a primary context retained in `DeviceGate::new` and
    // never released, so a valid handle; pushing it is allowed on any thread.
    driver(unsafe { cu::cuCtxPushCurrent_v2(ctx.0) }, "cuCtxPushCurrent")?;
    let out = f();
    let mut popped = std::ptr::null_mut();
    // SAFETY: pops the context pushed above (f pushes and pops in pairs
    // only, through this function); `popped` is a live local.
    let _ = unsafe { cu::cuCtxPopCurrent_v2(&mut popped) };
    out
}

#[derive(Clone, Copy)]
struct Context(cu::CUcontext);
// SAFETY: the primary context is the process's, never released here, and
// the driver lets any thread push it: the handle may move between threads.
unsafe impl Send for Context {}
// SAFETY: as for Send; the handle is only copied and passed to the driver.
unsafe impl Sync for Context {}

/// Whether the CUDA stream with native handle `stream` is being captured
/// into a graph; None where the driver cannot say. The legacy default
/// stream (handle 0) never is: capture there is not allowed.
///
/// # Safety
/// `stream` must be 0 or a live CUDA stream of a context that is current on
/// this thread (the caller's current stream, as torch's guard gives it).
pub unsafe fn capturing(stream: usize) -> Option<bool> {
    if stream == 0 {
        return Some(false);
    }
    available().ok()?;
    let mut status: u32 = 0;
    // SAFETY: the driver is loaded with this symbol (`available`); the stream
    // is live, per the caller's contract; the out-pointer is a live u32, the
    // size of the enum the driver writes, read back as a plain integer.
    let r = unsafe { cu::cuStreamIsCapturing(stream as cu::CUstream, (&mut status as *mut u32).cast()) };
    check(r, "cuStreamIsCapturing").ok()?;
    Some(status != 0)
}

/// A stream of ours, as its native handle (what c10 wraps as an external stream).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Stream(pub usize);

/// Streams of ours outlive the groups that used them: torch's caching
/// allocator may record events on them when a tensor they touched is freed,
/// later. A destroyed group's streams, once idle, go here for the next.
static SPARE_STREAMS: Mutex<level::SpareStreams, Vec<(i32, Stream)>> = Mutex::new(Vec::new());

/// One device's driver state for a group: its context, three streams of
/// ours, and a word of pinned host memory mapped into the device.
pub struct DeviceGate {
    device: i32,
    ctx: Context,
    streams: [Stream; 3],
    /// The word, as the host writes it and as the device reads it.
    word: *mut AtomicU32,
    word_on_device: cu::CUdeviceptr,
}

// SAFETY: the word is pinned host memory that lives until Drop (which has
// the gate to itself) and is only touched through &AtomicU32; the context,
// stream and device-pointer handles are the driver's, usable from any
// thread (each call pushes the context first).
unsafe impl Send for DeviceGate {}
// SAFETY: as for Send: shared use is atomic stores to the word and driver
// calls on thread-safe handles.
unsafe impl Sync for DeviceGate {}

/// How long a group's teardown waits for its streams to drain before it
/// gives up on reusing them (the word's memory is then left allocated).
const DRAIN: Duration = Duration::from_secs(10);

impl DeviceGate {
    /// For CUDA device `device` (torch's index): its primary context, three
    /// non-blocking streams (the held copies back; a side stream, which the
    /// futures' events are ordered on; one for failed ops' restores, which
    /// nothing else waits on or for), and the word, which starts at 0.
    pub fn new(device: i32) -> Result<DeviceGate> {
        available()?;
        let mut dev = 0;
        // SAFETY: the driver is initialised (`available`); `dev` is a live
        // local, and an ordinal out of range is an error, not UB.
        driver(unsafe { cu::cuDeviceGet(&mut dev, device) }, "cuDeviceGet")?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `dev` is a device handle the driver just gave; `ctx` a live
        // local. The retain is never released: the context is torch's too.
        driver(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain")?;
        let ctx = Context(ctx);
        in_context(ctx, || {
            let streams = [spare_or_new(device)?, spare_or_new(device)?, spare_or_new(device)?];
            let mut host = std::ptr::null_mut();
            let flags = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
            // SAFETY: the context is current (in_context); `host` is a live
            // local the driver writes the allocation's address into.
            driver(unsafe { cu::cuMemHostAlloc(&mut host, std::mem::size_of::<u32>(), flags) }, "cuMemHostAlloc")?;
            let word = host as *mut AtomicU32;
            // SAFETY: a fresh allocation of 4 bytes, page-aligned (so aligned
            // for AtomicU32) and not yet known to the device or any thread.
            unsafe { word.write(AtomicU32::new(0)) };
            let mut word_on_device = 0;
            let mapped = driver(
                // SAFETY: `host` is memory cuMemHostAlloc gave with DEVICEMAP,
                // in the current context; flags must be 0; the out-pointer is a live local.
                unsafe { cu::cuMemHostGetDevicePointer_v2(&mut word_on_device, host, 0) },
                "cuMemHostGetDevicePointer",
            );
            if let Err(e) = mapped {
                // SAFETY: the allocation above, freed once: no gate owns it
                // and no stream was told its device address.
                unsafe { cu::cuMemFreeHost(host) };
                SPARE_STREAMS.lock().unwrap().extend(streams.map(|s| (device, s)));
                return Err(e);
            }
            Ok(DeviceGate { device, ctx, streams, word, word_on_device })
        })
    }

    /// The stream the held copies back run on, the side stream, and the restore stream.
    pub fn streams(&self) -> [Stream; 3] {
        self.streams
    }

    /// Queue on the held stream: wait until the word has reached `value`
    /// (a cyclic comparison: `(i32)(word - value) >= 0`).
    pub fn hold_until(&self, value: u32) -> Result<()> {
        let stream = self.streams[0].0 as cu::CUstream;
        let geq = cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        in_context(self.ctx, || {
            driver(
                // SAFETY: the stream is ours (made by cuStreamCreate, never
                // destroyed) and the address is the word's device mapping,
                // which Drop frees only once the streams are idle; the
                // context they belong to is current.
                unsafe { cu::cuStreamWaitValue32_v2(stream, self.word_on_device, value, geq) },
                "cuStreamWaitValue32",
            )
        })
    }

    /// Write the word: every wait for it, or for less, goes on.
    pub fn release_to(&self, value: u32) {
        // SAFETY: the word was initialised in `new` and is freed only in Drop,
        // which cannot run while `self` is borrowed; it is only ever accessed
        // as an atomic (the device reads it, nothing writes it but this).
        unsafe { &*self.word }.store(value, Ordering::Release);
    }

    fn idle(&self) -> bool {
        self.streams
            .iter()
            // SAFETY: our streams, never destroyed; called with their context current (Drop's in_context).
            .all(|s| unsafe { cu::cuStreamQuery(s.0 as cu::CUstream) } != cu::CUresult::CUDA_ERROR_NOT_READY)
    }
}

fn spare_or_new(device: i32) -> Result<Stream> {
    let mut spare = SPARE_STREAMS.lock().unwrap();
    if let Some(i) = spare.iter().position(|(d, _)| *d == device) {
        return Ok(spare.swap_remove(i).1);
    }
    drop(spare);
    let mut s = std::ptr::null_mut();
    let non_blocking = cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: called inside in_context (the device's context is current);
    // `s` is a live local for the new handle.
    driver(unsafe { cu::cuStreamCreate(&mut s, non_blocking) }, "cuStreamCreate")?;
    Ok(Stream(s as usize))
}

impl Drop for DeviceGate {
    /// Every op has released its copies by now (the engine has stopped), but
    /// the device may not have read the word yet: wait for the streams to
    /// drain before the word's memory goes.
    fn drop(&mut self) {
        let deadline = Instant::now() + DRAIN;
        let drained = in_context(self.ctx, || {
            while !self.idle() {
                if Instant::now() > deadline {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // SAFETY: the allocation `new` made, freed once (Drop runs once),
            // after the streams that wait on it are idle so the device reads
            // it no more; `&mut self`: no borrow of the word is left.
            unsafe { cu::cuMemFreeHost(self.word as *mut std::ffi::c_void) };
            Ok(true)
        });
        match drained {
            Ok(true) => SPARE_STREAMS.lock().unwrap().extend(self.streams.map(|s| (self.device, s))),
            _ => {
                tracing::warn!("rustc10d: a CUDA stream still held copies at shutdown; its gate word is left allocated")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without the driver (CI's), using it is a clear error, not a panic.
    #[test]
    fn without_a_driver_it_says_so() {
        // SAFETY: as in `available`: loading libcuda runs only the driver's initialisers.
        if unsafe { cu::is_culib_present() } {
            return; // a machine with a driver: nothing to check here
        }
        let why = available().unwrap_err().message;
        assert!(why.contains("libcuda.so") && why.contains("stream-ordered"), "{why}");
        assert!(DeviceGate::new(0).is_err());
    }
}
