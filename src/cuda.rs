//! The CUDA driver, loaded at run time through cudarc (dynamic loading: the
//! library builds and imports without a CUDA toolkit or driver), and only
//! what stream-ordered completion needs from it: streams of our own, a word
//! of mapped pinned host memory the engine writes, and a stream's wait for
//! that word. Copies and events stay with torch (the shim), which already
//! orders them against the caller's streams.
//!
//! Every call runs with the device's primary context pushed (the one torch
//! uses), so it does not matter which thread calls or what it had current.

use crate::error::{Error, Result};
use cudarc::driver::sys as cu;
use std::ffi::CStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
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
    "cuGetErrorName",
];

/// Whether the driver can be used here: loaded once, with every symbol
/// above; else why not, in words.
pub fn available() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        // Safety: loading a library runs its initialisers; libcuda's are the driver's own.
        if !unsafe { cu::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so) could not be loaded".into());
        }
        let lib = unsafe { cu::culib() };
        let missing: Vec<&str> = SYMBOLS
            .iter()
            .copied()
            .filter(|s| unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err())
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "the CUDA driver lacks {} (a driver for CUDA 12 or newer is needed)",
                missing.join(", ")
            ));
        }
        check(unsafe { cu::cuInit(0) }, "cuInit")
    });
    loaded.clone().map_err(|why| Error::unsupported(format!("rustc10d: stream-ordered completion: {why}")))
}

fn check(r: cu::CUresult, what: &str) -> std::result::Result<(), String> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let named = unsafe { cu::cuGetErrorName(r, &mut name) } == cu::CUresult::CUDA_SUCCESS && !name.is_null();
    let name = if named { unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned() } else { format!("{r:?}") };
    Err(format!("{what} failed: {name}"))
}

fn driver(r: cu::CUresult, what: &str) -> Result<()> {
    check(r, what).map_err(|why| Error::io(format!("rustc10d: CUDA driver: {why}")))
}

/// A device's primary context, made current on this thread while `f` runs.
fn in_context<T>(ctx: Context, f: impl FnOnce() -> Result<T>) -> Result<T> {
    driver(unsafe { cu::cuCtxPushCurrent_v2(ctx.0) }, "cuCtxPushCurrent")?;
    let out = f();
    let mut popped = std::ptr::null_mut();
    let _ = unsafe { cu::cuCtxPopCurrent_v2(&mut popped) };
    out
}

#[derive(Clone, Copy)]
struct Context(cu::CUcontext);
// The primary context is the process's, never released here: any thread may push it.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

/// A stream of ours, as its native handle (what c10 wraps as an external stream).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Stream(pub usize);

/// Streams of ours outlive the groups that used them: torch's caching
/// allocator may record events on them when a tensor they touched is freed,
/// later. A destroyed group's streams, once idle, go here for the next.
static SPARE_STREAMS: Mutex<Vec<(i32, Stream)>> = Mutex::new(Vec::new());

/// One device's driver state for a group: its context, two streams of ours,
/// and a word of pinned host memory mapped into the device.
pub struct DeviceGate {
    device: i32,
    ctx: Context,
    streams: [Stream; 2],
    /// The word, as the host writes it and as the device reads it.
    word: *mut AtomicU32,
    word_on_device: cu::CUdeviceptr,
}

// The word is written with atomics only; the handles are the driver's, usable from any thread.
unsafe impl Send for DeviceGate {}
unsafe impl Sync for DeviceGate {}

/// How long a group's teardown waits for its streams to drain before it
/// gives up on reusing them (the word's memory is then left allocated).
const DRAIN: Duration = Duration::from_secs(10);

impl DeviceGate {
    /// For CUDA device `device` (torch's index): its primary context, two
    /// non-blocking streams (the held copies back, and a side stream), and
    /// the word, which starts at 0.
    pub fn new(device: i32) -> Result<DeviceGate> {
        available()?;
        let mut dev = 0;
        driver(unsafe { cu::cuDeviceGet(&mut dev, device) }, "cuDeviceGet")?;
        let mut ctx = std::ptr::null_mut();
        driver(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain")?;
        let ctx = Context(ctx);
        in_context(ctx, || {
            let streams = [spare_or_new(device)?, spare_or_new(device)?];
            let mut host = std::ptr::null_mut();
            let flags = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
            driver(unsafe { cu::cuMemHostAlloc(&mut host, std::mem::size_of::<u32>(), flags) }, "cuMemHostAlloc")?;
            let word = host as *mut AtomicU32;
            unsafe { word.write(AtomicU32::new(0)) };
            let mut word_on_device = 0;
            let mapped = driver(
                unsafe { cu::cuMemHostGetDevicePointer_v2(&mut word_on_device, host, 0) },
                "cuMemHostGetDevicePointer",
            );
            if let Err(e) = mapped {
                unsafe { cu::cuMemFreeHost(host) };
                SPARE_STREAMS.lock().unwrap().extend(streams.map(|s| (device, s)));
                return Err(e);
            }
            Ok(DeviceGate { device, ctx, streams, word, word_on_device })
        })
    }

    /// The stream the held copies back run on, and the side stream.
    pub fn streams(&self) -> [Stream; 2] {
        self.streams
    }

    /// Queue on the held stream: wait until the word has reached `value`
    /// (a cyclic comparison: `(i32)(word - value) >= 0`).
    pub fn hold_until(&self, value: u32) -> Result<()> {
        let stream = self.streams[0].0 as cu::CUstream;
        let geq = cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        in_context(self.ctx, || {
            driver(
                unsafe { cu::cuStreamWaitValue32_v2(stream, self.word_on_device, value, geq) },
                "cuStreamWaitValue32",
            )
        })
    }

    /// Write the word: every wait for it, or for less, goes on.
    pub fn release_to(&self, value: u32) {
        unsafe { &*self.word }.store(value, Ordering::Release);
    }

    fn idle(&self) -> bool {
        self.streams
            .iter()
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
        if unsafe { cu::is_culib_present() } {
            return; // a machine with a driver: nothing to check here
        }
        let why = available().unwrap_err().message;
        assert!(why.contains("libcuda.so") && why.contains("stream-ordered"), "{why}");
        assert!(DeviceGate::new(0).is_err());
    }
}
