//! Moving an op's tensors between their device and the host buffers the
//! engine works on (CUDA tensors, staged through pinned host memory). The
//! decisions live here: which buffers go in and come back, and whether one
//! large all_reduce or broadcast runs in pieces, so that the device copies of
//! one piece overlap the network transfer of another. The shim only provides
//! the device primitives (`Device`): copy a byte range one way or the other
//! in stream order, and wait for a copy.

use crate::algorithms::RawBuf;
use crate::error::Result;
use crate::ops::Collective;

/// One tensor that lives on a device: the engine works on its host copy.
#[derive(Debug, Clone, Copy)]
pub struct StagedBuffer {
    /// The host copy (what the op's RawBufs point into).
    pub host: RawBuf,
    /// The op reads it: copy it to the host before the op runs.
    pub copy_in: bool,
    /// The op writes it: copy it back once the op has succeeded.
    pub copy_out: bool,
    /// Byte ranges of the host copy are byte ranges of the device tensor
    /// (else it is only ever copied whole).
    pub contiguous: bool,
}

/// A marker that a queued copy to the host is done, once `Device::wait` says so.
pub type Event = u64;

/// The device side of one op's staged buffers (by index into `Staging::buffers`).
pub trait Device: Send {
    /// Queue a copy of bytes [start, start + len) of buffer `index` from the
    /// device to its host copy, after the work the caller had queued before
    /// the op; the event marks it done.
    fn to_host(&mut self, index: usize, start: usize, len: usize) -> Result<Event>;
    /// Block until the copy `event` marks is done.
    fn wait(&mut self, event: Event) -> Result<()>;
    /// Queue the copy of bytes [start, start + len) of buffer `index` back to the device.
    fn to_device(&mut self, index: usize, start: usize, len: usize) -> Result<()>;
}

/// An op's staged buffers and their device.
pub struct Staging {
    pub buffers: Vec<StagedBuffer>,
    pub device: Box<dyn Device>,
    /// All-reduces and broadcasts of one buffer larger than this run in pieces of it (0: never).
    pub piece_bytes: usize,
}

impl Staging {
    /// Bring every input to the host, waiting for the copies.
    pub fn all_in(&mut self) -> Result<()> {
        let mut events = Vec::new();
        for (i, b) in self.buffers.iter().enumerate().filter(|(_, b)| b.copy_in) {
            events.push(self.device.to_host(i, 0, b.host.len)?);
        }
        events.into_iter().try_for_each(|e| self.device.wait(e))
    }

    /// Queue every output's copy back.
    pub fn all_out(&mut self) -> Result<()> {
        for (i, b) in self.buffers.iter().enumerate().filter(|(_, b)| b.copy_out) {
            self.device.to_device(i, 0, b.host.len)?;
        }
        Ok(())
    }

    /// Queue a send's one buffer to the host now, and return the wait for it
    /// (the sending thread waits, not the caller).
    pub fn send_in(mut self) -> Result<impl FnOnce() -> Result<()> + Send> {
        let events = (0..self.buffers.len())
            .map(|i| self.device.to_host(i, 0, self.buffers[i].host.len))
            .collect::<Result<Vec<_>>>()?;
        Ok(move || events.into_iter().try_for_each(|e| self.device.wait(e)))
    }

    /// How the job runs: in pieces of the returned size, if it is one
    /// elementwise op whose one buffer is staged both ways and larger than a piece.
    pub fn pieces_for(&self, parts: &[Collective]) -> Option<usize> {
        let [part] = parts else { return None };
        let (buf, unit) = match part {
            Collective::AllReduce { buf, red } => (buf, red.dtype.size()),
            Collective::Broadcast { buf, .. } => (buf, 1),
            _ => return None,
        };
        let [b] = self.buffers[..] else { return None };
        let bytes = self.piece_bytes / unit * unit;
        let same = b.host.ptr == buf.ptr && b.host.len == buf.len && b.copy_in && b.copy_out;
        (same && bytes > 0 && buf.len > bytes).then_some(bytes)
    }
}

/// Bytes [start, start + len) of an elementwise op's one buffer, as an op of its own.
pub fn piece_of(part: &Collective, start: usize, len: usize) -> Collective {
    let sub = |b: &RawBuf| {
        assert!(start + len <= b.len);
        RawBuf::new(unsafe { b.ptr.add(start) }, len)
    };
    match part {
        Collective::AllReduce { buf, red } => Collective::AllReduce { buf: sub(buf), red: *red },
        Collective::Broadcast { buf, root } => Collective::Broadcast { buf: sub(buf), root: *root },
        _ => unreachable!("only elementwise ops run in pieces"),
    }
}

/// Run `part` in pieces of `bytes`: every piece's copy to the host is queued
/// at once; piece i runs (`run(i, piece)`) once its copy is done, and its
/// result is queued for the copy back right away. A buffer whose device
/// tensor is not contiguous comes in whole before piece 0 and goes back whole
/// after the last (every rank still cuts the op the same way).
pub fn run_in_pieces(
    staging: &mut Staging,
    part: &Collective,
    bytes: usize,
    mut run: impl FnMut(usize, &Collective) -> Result<()>,
) -> Result<()> {
    let b = staging.buffers[0];
    let len = b.host.len;
    let ranges: Vec<(usize, usize)> = (0..len).step_by(bytes).map(|s| (s, bytes.min(len - s))).collect();
    let dev = &mut staging.device;
    let events = if b.contiguous {
        ranges.iter().map(|&(s, n)| dev.to_host(0, s, n)).collect::<Result<Vec<_>>>()?
    } else {
        vec![dev.to_host(0, 0, len)?]
    };
    for (i, &(start, n)) in ranges.iter().enumerate() {
        if let Some(&e) = events.get(i) {
            dev.wait(e)?;
        }
        run(i, &piece_of(part, start, n))?;
        if b.contiguous {
            dev.to_device(0, start, n)?;
        }
    }
    if !b.contiguous {
        dev.to_device(0, 0, len)?;
    }
    Ok(())
}
