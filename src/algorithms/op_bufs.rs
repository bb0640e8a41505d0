//! An op's buffers as its algorithm takes them: slices, which the engine
//! makes of the caller's memory once, where the op starts (`engine::lend`).

/// The buffers of one collective, as its algorithm takes them.
pub struct OpBufs<'a> {
    /// The input blocks, one per rank, where the op has one per rank
    /// (reduce-scatter, all-to-all, scatter at the root), with this rank's
    /// own left empty: it is `own`. The sparse all-reduce's indices and
    /// values. Empty otherwise.
    pub inputs: Vec<&'a [u8]>,
    /// This rank's own input block, or its one input (all-gather, gather);
    /// None where it is in place, the very memory of its output block
    /// (`outputs[rank]`, or the one output), or where it has none.
    pub own: Option<&'a [u8]>,
    /// The output blocks, one per rank (all-gather, all-to-all, gather at
    /// the root), or the one output (reduce-scatter, scatter), or the one
    /// buffer (all-reduce, reduce, broadcast). Empty where it has none.
    pub outputs: Vec<&'a mut [u8]>,
}
