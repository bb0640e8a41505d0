//! A member that knows the key and speaks the collectives' protocol, but
//! lies in it: its call check says it called another op, another dtype, an
//! op that does not exist; its sparse all-reduce sends more rows than the
//! tensor holds, more than memory holds, or indices outside the tensor.
//! Each fails the op on the honest rank, naming the impostor's rank, at
//! once and without a panic. (The same lies told through the in-memory
//! transport, by a rank that runs the algorithm itself: algorithms_fake.rs.)

#[path = "../support/hostile/mod.rs"]
mod hostile;

use hostile::honest::{all_gather, shut_down, sparse_all_reduce};
use hostile::impostor::{group_with_impostor, Wire};
use hostile::*;
use rustc10d::error::ErrorKind;
use rustc10d::ops::OpKind;
use rustc10d::transport::links::frame::Key;

const TIMEOUT: Duration = Duration::from_secs(20);
const PROMPT: Duration = Duration::from_secs(5);

fn pair() -> (Engine, Wire) {
    let (mut engines, mut wires) = group_with_impostor(2, 1, TIMEOUT);
    (engines[0].take().unwrap(), wires[0].take().unwrap())
}

/// What the impostor changes in the fingerprint it sends back.
type Lie = dyn Fn(&mut Vec<u8>);

/// The impostor answers rank 0's call check with the fingerprint of
/// another call (its bytes: op, dtype, reduce op, 0, root, bytes, piece,
/// shape; an all-gather's bytes are those of all its outputs): a mismatch
/// that names it and says what each called, or, for an op code that does
/// not exist, that its call cannot be read.
#[test]
fn a_call_check_that_differs_is_a_mismatch_naming_the_impostor() {
    let (bystanders, _, _) = group_via(2, TransportMode::Tcp);
    let lies: [(&str, &Lie, &str); 6] = [
        ("another op", &|f| f[0] = OpKind::Broadcast.code(), "rank 1 called broadcast(128 bytes"),
        ("a dtype", &|f| f[1] = DType::F32 as u8, "dtype torch.float32"),
        ("another size", &|f| f[8..16].copy_from_slice(&256u64.to_le_bytes()), "rank 1 called allgather(256 bytes"),
        ("a dtype only moved", &|f| f[1] = 200, "dtype torch ScalarType 136"),
        ("an unknown dtype", &|f| f[1] = 40, "dtype code 40"),
        ("an op that does not exist", &|f| f[0] = 200, "unknown op code 200"),
    ];
    for (what, lie, says) in lies {
        let (e, wire) = pair();
        let op = all_gather(&e, 64, 0xAA);
        let (seq, mut fingerprint) = wire.fingerprint();
        lie(&mut fingerprint);
        wire.frame(Key::collective(seq, u64::MAX), fingerprint.len() as u64, &fingerprint);
        let out = op.finish(TIMEOUT * 2);
        let err = out.failed_saying(PROMPT, &["does not match the call on rank 1", says]);
        assert_eq!(err.kind, ErrorKind::Mismatch, "{what}: {}", err.message);
        eprintln!("{what}: {}", err.message);
        shut_down(e);
    }
    still_works(&bystanders);
}

/// A sparse all-reduce of one-dimensional tensors of `size` rows: rank 0
/// holds row 0; the impostor passes the call check, tells a row count of
/// `count`, and sends `indices` as its rows' indices.
fn sparse_with_a_liar(size: u64, count: u64, indices: &[i64]) -> rustc10d::error::Error {
    let (e, wire) = pair();
    let op = sparse_all_reduce(&e, size, &[0]);
    let seq = wire.echo_call_check();
    // Round 0 gathers the counts around the ring (piece 0, step 0), round 1
    // the indices (piece 1): the keys `OpCtx::key` gives each piece's step 0.
    wire.frame(Key::collective(seq, 0), 8, &count.to_le_bytes());
    if !indices.is_empty() {
        let rows: Vec<u8> = indices.iter().flat_map(|i| i.to_ne_bytes()).collect();
        wire.frame(Key::collective(seq, 1 << 32), rows.len() as u64, &rows);
    }
    let err = op.finish(TIMEOUT * 2).failed_saying(PROMPT, &["rank 1 "]);
    shut_down(e);
    err
}

#[test]
fn a_sparse_row_count_larger_than_the_tensor_names_the_impostor() {
    let err = sparse_with_a_liar(4, 5, &[]);
    assert!(err.message.contains("a count of 5 rows") && err.message.contains("at most 4"), "{}", err.message);
}

/// A count the tensor's shape allows (2^50 rows of a tensor of 2^50) but
/// whose rows no memory holds: 8 PiB to gather them. The allocation fails,
/// and fails the op naming the impostor, instead of aborting the process.
#[test]
fn a_sparse_row_count_larger_than_memory_names_the_impostor() {
    let err = sparse_with_a_liar(1 << 50, (1 << 50) - 1, &[]);
    eprintln!("{}", err.message);
    assert!(err.message.contains(&format!("a count of {} rows", (1u64 << 50) - 1)), "{}", err.message);
}

#[test]
fn sparse_indices_outside_the_tensor_name_the_impostor() {
    for (index, says) in [(4, "index 4"), (-1, "index -1"), (i64::MIN, "index -9223372036854775808")] {
        let err = sparse_with_a_liar(4, 1, &[index]);
        assert!(err.message.contains(says) && err.message.contains("outside sizes [4]"), "{}", err.message);
    }
}
