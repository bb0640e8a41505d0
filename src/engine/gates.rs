//! Stream-ordered completion on a device whose streams can wait for a word
//! of host memory (CUDA's `cuStreamWaitValue32`): at issue, an op queues on
//! its group's held stream a wait for its ticket, then its copies back; the
//! engine writes the word when the op has ended, and the device goes on. So
//! `Work.wait()` only orders the caller's stream after those copies and
//! returns; the host never blocks.
//!
//! One word per group and device, and tickets in issue order: the word is
//! only ever raised to a ticket whose op and every op before it have ended,
//! so a wait for ticket t goes on exactly when ops 1..=t have released
//! theirs. An op that ends before an earlier one (ops issued from two
//! threads at once) waits for it. A failed op first makes its host copies
//! equal to the device's bytes (`Staging::settle`), so what its held copies
//! write back leaves every tensor as it was; every path releases its ticket.

use super::staging::{Device, Event, Gates};
use crate::error::Result;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// The device side of a gate: a word that a held stream waits for.
pub trait GateWord: Send + Sync {
    /// Queue on the held stream: wait until the word reaches `value`.
    fn hold_until(&self, value: u32) -> Result<()>;
    /// Write the word.
    fn release_to(&self, value: u32);
}

impl GateWord for crate::cuda::DeviceGate {
    fn hold_until(&self, value: u32) -> Result<()> {
        crate::cuda::DeviceGate::hold_until(self, value)
    }
    fn release_to(&self, value: u32) {
        crate::cuda::DeviceGate::release_to(self, value)
    }
}

/// Which tickets have been released: pure state, no device.
#[derive(Debug, Default)]
pub struct ReleaseOrder {
    /// The word's value: every ticket up to it is released.
    released: u32,
    /// Tickets issued after `released`, in order: whether each has ended.
    pending: VecDeque<bool>,
}

impl ReleaseOrder {
    /// The ticket the next op takes (not taken until `issue`).
    pub fn next(&self) -> u32 {
        self.released.wrapping_add(self.pending.len() as u32).wrapping_add(1)
    }

    pub fn issue(&mut self) -> u32 {
        let t = self.next();
        self.pending.push_back(false);
        t
    }

    /// Ticket `t`'s op has ended: the word's new value, if it moves.
    pub fn end(&mut self, t: u32) -> Option<u32> {
        let i = t.wrapping_sub(self.released).wrapping_sub(1) as usize;
        let slot = self.pending.get_mut(i).expect("a ticket that was issued and has not ended");
        assert!(!*slot, "ticket {t} ended twice");
        *slot = true;
        let before = self.released;
        while self.pending.front() == Some(&true) {
            self.pending.pop_front();
            self.released = self.released.wrapping_add(1);
        }
        (self.released != before).then_some(self.released)
    }
}

/// A group's gates on one device.
pub struct StreamGates {
    word: Box<dyn GateWord>,
    order: Mutex<ReleaseOrder>,
}

impl StreamGates {
    pub fn new(word: Box<dyn GateWord>) -> StreamGates {
        StreamGates { word, order: Mutex::default() }
    }

    /// Queue a wait for a new ticket on the held stream; what is queued
    /// there next runs once the ticket is released.
    pub fn hold(&self) -> Result<u32> {
        let mut order = self.order.lock().unwrap();
        self.word.hold_until(order.next())?;
        Ok(order.issue())
    }

    /// Ticket `t`'s op has ended (under the lock, so the word only rises).
    pub fn release(&self, t: u32) {
        let mut order = self.order.lock().unwrap();
        if let Some(v) = order.end(t) {
            self.word.release_to(v);
        }
    }
}

/// What the shim offers for copies back held behind a gate.
pub trait HeldCopies: Device {
    /// Queue the copy of bytes [start, start + len) of buffer `index` back
    /// to the device on the held stream (behind the gate queued there).
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> Result<()>;
    /// Make bytes [start, start + len) of buffer `index`'s host copy what
    /// the device holds there, now, on a stream that nothing holds.
    fn restore(&mut self, index: usize, start: usize, len: usize) -> Result<()>;
}

/// One op's copies on a device with gates.
pub struct GatedOp<D> {
    device: D,
    gates: Arc<StreamGates>,
    /// Taken with the op's first held copy; released once.
    ticket: Option<u32>,
}

impl<D: HeldCopies> GatedOp<D> {
    pub fn new(device: D, gates: Arc<StreamGates>) -> GatedOp<D> {
        GatedOp { device, gates, ticket: None }
    }
}

impl<D> GatedOp<D> {
    /// Release the op's ticket, if it took one and has not released it.
    fn release(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.gates.release(t);
        }
    }
}

impl<D: HeldCopies> Device for GatedOp<D> {
    fn to_host(&mut self, index: usize, start: usize, len: usize) -> Result<Event> {
        self.device.to_host(index, start, len)
    }
    fn wait(&mut self, event: Event) -> Result<()> {
        self.device.wait(event)
    }
    fn to_device(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        self.device.to_device(index, start, len)
    }
    fn gates(&mut self) -> Option<&mut dyn Gates> {
        Some(self)
    }
}

impl<D: HeldCopies> Gates for GatedOp<D> {
    fn to_device_held(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        if self.ticket.is_none() {
            self.ticket = Some(self.gates.hold()?);
        }
        self.device.to_device_held(index, start, len)
    }

    fn open(&mut self) {
        self.release();
    }

    fn restore(&mut self, index: usize, start: usize, len: usize) -> Result<()> {
        self.device.restore(index, start, len)
    }

    /// The consumer is a stream, ordered after the copies back: nothing to wait for.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

impl<D> Drop for GatedOp<D> {
    /// An op dropped before it settled still lets its copies through.
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_rises_only_over_ended_tickets() {
        let mut o = ReleaseOrder::default();
        let (a, b, c) = (o.issue(), o.issue(), o.issue());
        assert_eq!((a, b, c), (1, 2, 3));
        assert_eq!(o.end(b), None, "1 has not ended");
        assert_eq!(o.end(a), Some(2), "1 and 2 go together");
        assert_eq!(o.next(), 4);
        assert_eq!(o.end(c), Some(3));
    }

    #[test]
    fn tickets_wrap_around() {
        let mut o = ReleaseOrder { released: u32::MAX - 1, pending: VecDeque::new() };
        let (a, b, c) = (o.issue(), o.issue(), o.issue());
        assert_eq!((a, b, c), (u32::MAX, 0, 1));
        assert_eq!(o.end(c), None);
        assert_eq!(o.end(b), None);
        assert_eq!(o.end(a), Some(1));
    }

    #[test]
    #[should_panic(expected = "ended twice")]
    fn a_ticket_ends_once() {
        let mut o = ReleaseOrder::default();
        let (_a, b) = (o.issue(), o.issue());
        o.end(b);
        o.end(b);
    }
}
