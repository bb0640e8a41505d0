//! Moving an op's tensors between their device and the host buffers the
//! engine works on (CUDA tensors, staged through pinned host memory). The
//! decisions live here: which buffers go in and come back, and whether one
//! large all_reduce or broadcast runs in pieces, so that the copies in of
//! later pieces overlap the network transfer of earlier ones. Results go
//! back only once the whole op has succeeded, so a failed op leaves every
//! tensor as it was. The shim only provides the device primitives
//! (`Device`): copy a byte range one way or the other in stream order, and
//! wait for a copy.

use crate::error::Result;
use crate::ops::Collective;
use crate::ops::RawBuf;

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
    /// Stream-ordered completion, where the device offers it.
    fn gates(&mut self) -> Option<&mut dyn Gates> {
        None
    }
}

/// Stream-ordered completion: every copy of an op is queued when it is
/// issued, the copies back behind the op's gate, which the engine opens
/// once the op has ended. So the op's consumer (a stream) can be ordered
/// after them before the network part is done. A failed op's gate opens
/// once its host copies hold the device's bytes (which nothing has written
/// yet), so what is copied back leaves every tensor as it was.
pub trait Gates {
    /// Queue the copy of bytes [start, start + len) of buffer `index` back
    /// to the device, to run once the gate opens.
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> Result<()>;
    /// The op has succeeded: open the gate.
    fn open(&mut self);
    /// The op has failed: open the gate once the host copies of `outs`
    /// (buffer, len) hold what the device holds (gates.rs: in ticket order,
    /// on the gates' thread, not the caller's).
    fn open_unchanged(&mut self, outs: Vec<(usize, usize)>);
    /// The gates and the op's ticket, once it holds copies back.
    fn ticket(&self) -> Option<(std::sync::Arc<super::StreamGates>, u32)>;
    /// Where the op's consumer is the host: what runs its completion once
    /// its copies back have run.
    fn after_copies(&self) -> Option<super::AfterCopies>;
}

/// An op's staged buffers and their device.
pub struct Staging {
    pub buffers: Vec<StagedBuffer>,
    pub device: Box<dyn Device>,
    /// All-reduces and broadcasts of one buffer larger than this run in pieces of it (0: never).
    pub piece_bytes: usize,
    /// With gates, once `queue` has queued every copy: the copies in (one
    /// per piece, or per input), and whether the copies back are still held.
    queued: Option<(Vec<Event>, bool)>,
}

impl Staging {
    pub fn new(buffers: Vec<StagedBuffer>, device: Box<dyn Device>, piece_bytes: usize) -> Staging {
        Staging { buffers, device, piece_bytes, queued: None }
    }

    /// At issue, on the caller's thread: where the device has gates, queue
    /// every copy in and, behind the gate, every copy back. A device without
    /// them is driven by the engine's thread as the op runs.
    pub fn queue(&mut self, parts: &[Collective]) -> Result<()> {
        if self.device.gates().is_none() {
            return Ok(());
        }
        let ins = self.ins(self.pieces_for(parts));
        // Noted first: however queueing fails, settling lets the copies through.
        self.queued = Some((Vec::new(), true));
        // The copies in go first: in stream order nothing passes a held copy.
        let events = ins.into_iter().map(|(i, s, n)| self.device.to_host(i, s, n)).collect::<Result<Vec<_>>>()?;
        self.queued.as_mut().unwrap().0 = events;
        let outs: Vec<(usize, usize)> = self.outs().collect();
        let gates = self.device.gates().expect("checked above");
        outs.into_iter().try_for_each(|(i, n)| gates.to_device_held(i, 0, n))
    }

    /// The copies in, as (buffer, start, len): one per piece of a buffer
    /// run in pieces of `pieces` bytes (whole where it is not contiguous),
    /// else one per input.
    fn ins(&self, pieces: Option<usize>) -> Vec<(usize, usize, usize)> {
        match (pieces, self.buffers[0]) {
            (Some(bytes), b) if b.contiguous => ranges(b.host.len, bytes).into_iter().map(|(s, n)| (0, s, n)).collect(),
            (Some(_), b) => vec![(0, 0, b.host.len)],
            (None, _) => {
                self.buffers.iter().enumerate().filter(|(_, b)| b.copy_in).map(|(i, b)| (i, 0, b.host.len)).collect()
            }
        }
    }

    /// The outputs, as (buffer, len): copied back whole.
    fn outs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.buffers.iter().enumerate().filter(|(_, b)| b.copy_out).map(|(i, b)| (i, b.host.len))
    }

    /// Bring every input to the host, waiting for the copies.
    pub fn all_in(&mut self) -> Result<()> {
        let events = match &self.queued {
            Some((events, _)) => events.clone(),
            None => self.ins(None).into_iter().map(|(i, s, n)| self.device.to_host(i, s, n)).collect::<Result<_>>()?,
        };
        events.into_iter().try_for_each(|e| self.device.wait(e))
    }

    /// The op has succeeded: copy every output back.
    pub fn all_out(&mut self) -> Result<()> {
        if let Some((_, held)) = &mut self.queued {
            *held = false;
            self.device.gates().expect("queued with gates").open();
            return Ok(());
        }
        let outs: Vec<(usize, usize)> = self.outs().collect();
        outs.into_iter().try_for_each(|(i, n)| self.device.to_device(i, 0, n))
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

    /// The op has ended (`ok`: it succeeded and `all_out` ran). With gates:
    /// a copy back still held (the op failed) is let through once the device's
    /// own bytes are there to copy, so no tensor changes and nothing waits
    /// forever. Call it before the op's completion runs.
    pub fn settle(&mut self) {
        let Some((_, true)) = self.queued.take() else { return };
        let outs = self.outs().collect();
        self.device.gates().expect("queued with gates").open_unchanged(outs);
    }

    /// The gates and this op's ticket, where it holds copies back behind one.
    pub fn ticket(&mut self) -> Option<(std::sync::Arc<super::StreamGates>, u32)> {
        self.device.gates().and_then(|g| g.ticket())
    }

    /// Where the op's consumer is the host (test staging), what runs its
    /// completion once its copies back have run.
    pub fn after_copies(&mut self) -> Option<super::AfterCopies> {
        self.device.gates().and_then(|g| g.after_copies())
    }
}

impl Drop for Staging {
    /// However the op ended, nothing stays held (`settle` has run unless
    /// the op was dropped before it ran).
    fn drop(&mut self) {
        self.settle();
    }
}

/// [start, len) of each piece of `bytes` of a buffer of `len`.
fn ranges(len: usize, bytes: usize) -> Vec<(usize, usize)> {
    (0..len).step_by(bytes).map(|s| (s, bytes.min(len - s))).collect()
}

/// Bytes [start, start + len) of an elementwise op's one buffer, as an op of its own.
pub fn piece_of(part: &Collective, start: usize, len: usize) -> Collective {
    let sub = |b: &RawBuf| {
        assert!(start + len <= b.len);
        // SAFETY: start + len <= b.len (asserted just above): the piece starts
        // inside the op's buffer.
        RawBuf::new(unsafe { b.ptr.add(start) }, len)
    };
    match part {
        Collective::AllReduce { buf, red } => Collective::AllReduce { buf: sub(buf), red: *red },
        Collective::Broadcast { buf, root, dtype } => {
            Collective::Broadcast { buf: sub(buf), root: *root, dtype: *dtype }
        }
        _ => unreachable!("only elementwise ops run in pieces"),
    }
}

/// Run `part` in pieces of `bytes`: every piece's copy to the host is queued
/// at once (at issue, with gates); piece i runs (`run(i, piece)`) once its
/// copy is done; the results go back once every piece has succeeded. A
/// buffer whose device tensor is not contiguous comes in whole before piece
/// 0 (every rank still cuts the op the same way).
pub fn run_in_pieces(
    staging: &mut Staging,
    part: &Collective,
    bytes: usize,
    mut run: impl FnMut(usize, &Collective) -> Result<()>,
) -> Result<()> {
    let events = match &staging.queued {
        Some((events, _)) => events.clone(),
        None => {
            let ins = staging.ins(Some(bytes));
            ins.into_iter().map(|(i, s, n)| staging.device.to_host(i, s, n)).collect::<Result<_>>()?
        }
    };
    for (i, (start, n)) in ranges(staging.buffers[0].host.len, bytes).into_iter().enumerate() {
        if let Some(&e) = events.get(i) {
            staging.device.wait(e)?;
        }
        run(i, &piece_of(part, start, n))?;
    }
    staging.all_out()
}
