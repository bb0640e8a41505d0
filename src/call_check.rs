//! Mismatched calls are caught before any data is used: every collective
//! first sends its right neighbour a fingerprint of how it was called (op,
//! dtype, reduce op, root, size) and compares the one from its left
//! neighbour. Around the ring, all ranks that pass agree with their left
//! neighbour; a rank that fails breaks the group, so nobody completes a
//! collective from a mismatched call set.

use crate::algorithms::OpCtx;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::Key;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    pub op: &'static str,
    /// DType code, or NONE where the op does not interpret data.
    pub dtype: u8,
    /// ReduceOp code (PREMUL_SUM as 8), or NONE.
    pub reduce: u8,
    pub root: u32,
    /// The byte count every rank must agree on (0 where sizes may differ).
    pub bytes: u64,
}

impl Fingerprint {
    pub const NONE: u8 = u8::MAX;
    const LEN: usize = 32;
    /// Ops by wire code; the index is what goes on the wire.
    const OPS: [&'static str; 10] = [
        "allreduce",
        "reduce",
        "broadcast",
        "allgather",
        "gather",
        "scatter",
        "reduce_scatter",
        "alltoall",
        "barrier",
        "monitored_barrier",
    ];

    fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0] = Self::OPS.iter().position(|&o| o == self.op).expect("known op") as u8;
        b[1] = self.dtype;
        b[2] = self.reduce;
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..16].copy_from_slice(&self.bytes.to_le_bytes());
        b
    }

    fn decode(b: &[u8; Self::LEN]) -> Result<Fingerprint> {
        let op = *Self::OPS.get(b[0] as usize).ok_or_else(|| Error::io(format!("unknown op code {}", b[0])))?;
        Ok(Fingerprint {
            op,
            dtype: b[1],
            reduce: b[2],
            root: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            bytes: u64::from_le_bytes(b[8..16].try_into().unwrap()),
        })
    }

    /// "allreduce(4096 bytes, dtype torch.float32, op SUM)".
    pub fn describe(&self) -> String {
        let mut parts = vec![format!("{} bytes", self.bytes)];
        if self.dtype != Self::NONE {
            let name = crate::dtype::DType::from_code(self.dtype).map(|d| d.torch_name()).unwrap_or("?");
            parts.push(format!("dtype {name}"));
        }
        if self.reduce != Self::NONE {
            let name = crate::dtype::ReduceOp::from_code(self.reduce).map(|o| o.name()).unwrap_or("PREMUL_SUM");
            parts.push(format!("op {name}"));
        }
        if self.root != u32::MAX {
            parts.push(format!("root {}", self.root));
        }
        format!("{}({})", self.op, parts.join(", "))
    }
}

/// Exchange fingerprints with the ring neighbours; fail if the left one differs.
pub fn agree(ctx: &OpCtx, mine: &Fingerprint) -> Result<()> {
    let (rank, world) = (ctx.transport.rank(), ctx.transport.size());
    if world == 1 {
        return Ok(());
    }
    let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
    let key = Key::collective(ctx.seq, u64::MAX);
    let out = mine.encode();
    let mut theirs = [0u8; Fingerprint::LEN];
    let tr = &mut ctx.transfers();
    let id = unsafe { tr.recv(left, key, theirs.as_mut_ptr(), theirs.len())? };
    unsafe { tr.send(right, key, &out)? };
    tr.wait(id)?;
    let theirs = Fingerprint::decode(&theirs)?;
    if theirs != *mine {
        return Err(Error::new(
            ErrorKind::Mismatch,
            format!(
                "rustc10d: {} does not match the call on rank {left}: rank {rank} called {}, rank {left} called {}",
                ctx.what,
                mine.describe(),
                theirs.describe()
            ),
        ));
    }
    tr.wait_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_description() {
        let f = Fingerprint { op: "reduce", dtype: 0, reduce: 4, root: 2, bytes: 4096 };
        assert_eq!(Fingerprint::decode(&f.encode()).unwrap(), f);
        assert_eq!(f.describe(), "reduce(4096 bytes, dtype torch.float32, op MAX, root 2)");
        let b = Fingerprint { op: "barrier", dtype: Fingerprint::NONE, reduce: Fingerprint::NONE, root: u32::MAX, bytes: 0 };
        assert_eq!(b.describe(), "barrier(0 bytes)");
    }
}
