//! Store-based rendezvous: pick the address peers can reach, publish it with
//! a protocol version, the settings every rank must share and this rank's
//! share of the group's key, find out whether the whole group can read each
//! other's memory (single-copy collectives), and bring up the mesh. With the
//! job's secret (secret.rs) every value read must carry its tag. Nothing
//! here tells a Store reader where anything lies in a process: same-host
//! peers learn each other's process from the kernel (SO_PEERCRED).

use crate::config::{Config, TransportMode};
use crate::error::{Error, ErrorKind, Result};
use crate::locks::{level, Condvar, Mutex};
use crate::secret::{Sealed, Secret};
use crate::transport::group::arena::Arena;
use crate::transport::group::arena_pool::ArenaPool;
use crate::transport::group::mesh::{ArenaRole, Layout, Mesh};
use crate::transport::links::auth::{fill_random, GroupKey, Identity, Share, SHARE_LEN};
use crate::transport::links::endpoint::{PeerAddr, ShmEndpoint};
use crate::transport::links::fd_limit;
use crate::transport::links::frame::PROTOCOL_VERSION;
use crate::transport::links::peer_reads::{let_peers_read, may_read};
use crate::transport::links::reactor::Reactor;
use crate::transport::links::{fdpass, ring};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};

/// The key/value store the group rendezvous through (torch's c10d Store, already
/// prefixed per group; an in-memory one in tests).
pub trait Store {
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Blocks until `key` exists or `timeout` passes.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Atomically add `delta` to the integer at `key` (0 if unset); returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Remove `key`; whether it was there.
    fn delete(&self, key: &str) -> Result<bool>;
}

/// A Store for tests: threads in one process share it.
#[derive(Default)]
pub struct MemStore {
    map: Mutex<level::StoreMap, HashMap<String, Vec<u8>>>,
    cv: Condvar,
    /// The last value of every key deleted since (`seen`).
    deleted: Mutex<level::StoreDeleted, HashMap<String, Vec<u8>>>,
}

impl MemStore {
    /// Everything in it, as a Store reader could list it (tests of what a rendezvous leaves there).
    pub fn entries(&self) -> Vec<(String, Vec<u8>)> {
        self.map.lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    /// Everything it held at some time, each key's last value: what a reader
    /// that watched it during a rendezvous saw (tests of what leaks there).
    pub fn seen(&self) -> Vec<(String, Vec<u8>)> {
        let mut all = self.deleted.lock().unwrap().clone();
        all.extend(self.entries());
        all.into_iter().collect()
    }

    /// `key`'s value now or, deleted, its last (see `seen`).
    pub fn seen_at(&self, key: &str) -> Option<Vec<u8>> {
        let now = self.map.lock().unwrap().get(key).cloned();
        now.or_else(|| self.deleted.lock().unwrap().get(key).cloned())
    }

    /// This Store as a reader that watched it from the start sees it: a
    /// key deleted since still reads as its last value.
    pub fn watcher(&self) -> Watcher<'_> {
        Watcher(self)
    }
}

/// A MemStore as a reader that watched it sees it (`MemStore::watcher`).
pub struct Watcher<'a>(&'a MemStore);

impl Store for Watcher<'_> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.0.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.0.seen_at(key).map_or_else(|| self.0.get(key, timeout), Ok)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.0.add(key, delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.0.delete(key)
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.map.lock().unwrap().insert(key.to_string(), value.to_vec());
        self.cv.notify_all();
        Ok(())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.map.lock().unwrap();
        let old = map.get(key).and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok()).unwrap_or(0);
        map.insert(key.to_string(), (old + delta).to_string().into_bytes());
        self.cv.notify_all();
        Ok(old + delta)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let Some(value) = self.map.lock().unwrap().remove(key) else { return Ok(false) };
        self.deleted.lock().unwrap().insert(key.to_string(), value);
        Ok(true)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.map.lock().unwrap();
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!("key {key} not set within {timeout:?}")));
            }
            map = self.cv.wait_timeout(map, deadline - now).unwrap().0;
        }
    }
}

/// Who this rank is in the group it joins.
#[derive(Debug, Clone)]
pub struct Member {
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
    /// Host of the Store's server, when known: we advertise the local address
    /// that routes to it, so that ranks on other machines can reach us.
    pub store_host: Option<String>,
}

/// What each rank publishes: how to reach it, on which host it runs, the
/// settings every rank must share (`Config::shared`), whether it offers
/// single copy, and its share of the group's key.
#[derive(Debug, Clone, PartialEq)]
struct Published {
    tcp: SocketAddr,
    host: String,
    /// Its shared-memory socket name, or None if it takes TCP only.
    shm: Option<String>,
    settings: String,
    /// Peers on its host may try to read its memory (single copy).
    single_copy: bool,
    share: Share,
}

impl Published {
    fn encode(&self) -> String {
        let shm = self.shm.as_deref().unwrap_or("-");
        let single_copy = if self.single_copy { "1" } else { "-" };
        let share: String = self.share.iter().map(|b| format!("{b:02x}")).collect();
        format!("v{PROTOCOL_VERSION} {} {} {shm} {} {single_copy} {share}", self.tcp, self.host, self.settings)
    }

    fn decode(text: &str) -> Option<Published> {
        let mut it = text.split(' ').skip(1);
        let tcp = it.next()?.parse().ok()?;
        let host = it.next()?.to_string();
        let shm = it.next().filter(|s| *s != "-").map(str::to_string);
        let settings = it.next()?.to_string();
        let single_copy = match it.next()? {
            "1" => true,
            "-" => false,
            _ => return None,
        };
        let hex = it.next()?;
        if hex.len() != 2 * SHARE_LEN || it.next().is_some() {
            return None;
        }
        let mut share = [0u8; SHARE_LEN];
        for (i, byte) in share.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Published { tcp, host, shm, settings, single_copy, share })
    }
}

/// Set up this rank's shared-memory endpoint, unless the mode says TCP.
/// In `auto`, a machine that cannot (no memfd, a sandbox) falls back to TCP.
fn shm_endpoint(cfg: &Config, rank: usize) -> Result<Option<(ShmEndpoint, String)>> {
    if cfg.transport == TransportMode::Tcp {
        return Ok(None);
    }
    let probe = ring::Segment::create(64 << 10).and_then(|_| ShmEndpoint::bind(cfg.shm_ring_bytes));
    match (probe, cfg.transport) {
        (Ok(ep), _) => Ok(Some(ep)),
        (Err(e), TransportMode::Shm) => Err(e.context(format!(
            "rustc10d: rank {rank}: the transport is shm (RUSTC10D_TRANSPORT) but shared memory is unavailable"
        ))),
        (Err(e), _) => {
            tracing::info!("rustc10d: rank {rank}: shared memory unavailable, using TCP only: {}", e.message);
            Ok(None)
        }
    }
}

/// Rendezvous through `store` and connect the ring neighbours. Every rank
/// checks every other rank's shared settings against its own, so ranks
/// configured differently all fail here, naming the setting.
pub fn connect(store: &dyn Store, me: &Member, cfg: &Config) -> Result<Mesh> {
    let (rank, size) = (me.rank, me.size);
    if size == 0 || rank >= size {
        return Err(Error::invalid(format!("rustc10d: rank {rank} is out of range for world size {size}")));
    }
    let deadline = Instant::now() + me.timeout;
    if cfg.raise_fd_limit {
        fd_limit::raise_soft_limit();
    }
    let store = &Sealed { store, secret: cfg.secret.as_deref() };
    let keys = Keys::join(store, size)?;
    let mut share: Share = [0; SHARE_LEN];
    fill_random(&mut share)?;
    // What this rank sets up by itself; if any of it fails, the others are
    // told at once instead of waiting for an address until their timeout.
    let local_setup = || -> Result<_> {
        let ip = choose_local_ip(cfg.socket_ifname.as_deref(), me.store_host.as_deref())?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
            Error::io(format!("rustc10d: rank {rank} could not listen on {ip}: {}", fd_limit::describe(&e)))
        })?;
        let addr = listener.local_addr().map_err(|e| Error::io(e.to_string()))?;
        // Holding a membership keeps the I/O thread, started here, until the mesh holds its own.
        let io = Reactor::join()?;
        let shm = shm_endpoint(cfg, rank)?;
        // Rank 0 makes the arena before it publishes, so that if it cannot
        // the others learn why at once; if the group spans hosts, it makes
        // one for its host's ranks instead, as every host's lowest rank does.
        let arena = (rank == 0 && size > 1 && shm.is_some() && cfg.arena_slot_bytes > 0)
            .then(|| {
                Arena::create(size, cfg.arena_slot_bytes, rank, ArenaPool::regions_for(size, cfg.arena_slot_bytes))
            })
            .transpose()?;
        Ok((listener, addr, io, shm, arena))
    };
    let (listener, addr, _io, shm, arena) = local_setup().inspect_err(|why| {
        refuse_in(store, &keys, rank, why);
        settle(store, &keys, size, true, deadline);
    })?;
    let (local, shm_name) = match shm {
        Some((ep, name)) => (Some(ep), Some(name)),
        None => (None, None),
    };
    let host = fdpass::host_key().unwrap_or_else(|| "unknown".into());
    // Whether peers on this host may read this rank's memory (single
    // copy), each finds out by trying, and the vote decides.
    let single_copy = cfg.single_copy_bytes > 0 && shm_name.is_some();
    let mine = Published { tcp: addr, host, shm: shm_name, settings: cfg.shared(), single_copy, share };
    store.set(&keys.addr(rank), mine.encode().as_bytes())?;
    let records = (0..size)
        .map(|peer| match peer == rank {
            true => Ok(mine.clone()),
            false => lookup_peer(store, &keys, cfg, rank, peer, me.timeout),
        })
        .collect::<Result<Vec<_>>>();
    let records = records.inspect_err(|e| {
        // Every rank reads a refusal, a differing setting or protocol; not who is missing.
        let shared = matches!(e.kind, ErrorKind::InvalidArgument | ErrorKind::Aborted);
        settle(store, &keys, size, shared, deadline);
    })?;
    let addrs: Vec<PeerAddr> = records
        .iter()
        .enumerate()
        .map(|(peer, theirs)| {
            // Shared memory when both ends offer it on the same host.
            let same_host = mine.shm.is_some() && theirs.host == mine.host && theirs.host != "unknown";
            PeerAddr { tcp: theirs.tcp, shm: theirs.shm.clone().filter(|_| same_host && peer != rank) }
        })
        .collect();
    // Where Yama lets only ancestors read a process, let the peers on this
    // host read this one, for as long as the group lives (peer_reads.rs),
    // and say so before any of them reads: only then is the probe readable.
    let same_host_peer = addrs.iter().any(|a| a.shm.is_some());
    let peer_reads = (single_copy && same_host_peer && cfg.ptracer_any).then(let_peers_read);
    if single_copy {
        store.set(&keys.readable(rank), b"1")?;
    }
    let single_copy = single_copy_group(store, &keys, rank, &records, me.timeout)?;
    keys.read_by(store, rank, &records);
    let hosts = number_hosts(&records);
    let with_arenas = hosts_with_arenas(cfg, &records, &hosts);
    let arena = arena_role(cfg, &hosts, with_arenas[hosts[rank]], rank, arena)?;
    let arena_on_every_host = with_arenas.iter().all(|&a| a);
    let layout = Layout { hosts, single_copy, arena, arena_on_every_host, peer_reads };

    // This rank's own record is `mine`, with its share as it drew it, never
    // the Store's: a group whose records were swapped for another's cannot
    // agree on a key.
    let shares: Vec<Share> = records.iter().map(|r| r.share).collect();
    let secret = cfg.secret.as_deref().map_or(&[][..], |s| s.bytes());
    let me = Identity::new(rank as u32, size as u32, GroupKey::derive(secret, &shares)).sealing(cfg.encrypt);
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    let ring: &[usize] = if size > 1 { &[right] } else { &[] };
    let from: &[usize] = if size > 1 { &[left] } else { &[] };
    let mesh = Mesh::start(listener, local, me, addrs, cfg, layout, ring, from, deadline)?;
    tracing::debug!("rustc10d: rank {rank}/{size} listening on {addr}");
    Ok(mesh)
}

/// Each rank's host, numbered in the order of their lowest rank; ranks whose
/// host is "unknown" each count as a host of their own (they talk TCP).
fn number_hosts(records: &[Published]) -> Vec<usize> {
    let mut seen: Vec<&str> = Vec::new();
    records
        .iter()
        .map(|r| match seen.iter().position(|&h| h == r.host && h != "unknown") {
            Some(h) => h,
            None => {
                seen.push(&r.host);
                seen.len() - 1
            }
        })
        .collect()
}

/// Whether each host's ranks (`hosts`, as `number_hosts` gives them) share
/// an arena: two or more of them, every one offering shared memory,
/// `arena_slot_bytes` above 0 (the same on every rank). Every rank computes
/// it alike, from the records. The ranks of hosts that get none talk
/// through their rings and sockets alone.
fn hosts_with_arenas(cfg: &Config, records: &[Published], hosts: &[usize]) -> Vec<bool> {
    let count = hosts.iter().max().map_or(0, |&h| h + 1);
    let (mut ranks, mut shm) = (vec![0usize; count], vec![cfg.arena_slot_bytes > 0; count]);
    for (record, &h) in records.iter().zip(hosts) {
        ranks[h] += 1;
        shm[h] &= record.shm.is_some() && record.host != "unknown";
    }
    ranks.iter().zip(shm).map(|(&n, shm)| n > 1 && shm).collect()
}

/// This rank's part in the shared arena of its host's ranks, if they get
/// one (`shared`, see `hosts_with_arenas`). In a group on one host that is
/// the group's arena, which rank 0 made before it published (`made`);
/// otherwise each host's lowest rank makes its host's now.
fn arena_role(cfg: &Config, hosts: &[usize], shared: bool, rank: usize, made: Option<Arena>) -> Result<ArenaRole> {
    if !shared {
        return Ok(ArenaRole::None);
    }
    let members: Vec<usize> = (0..hosts.len()).filter(|&r| hosts[r] == hosts[rank]).collect();
    if members[0] != rank {
        return Ok(ArenaRole::Join { members });
    }
    let arena = match made {
        Some(arena) if members.len() == hosts.len() => arena,
        _ => {
            let regions = ArenaPool::regions_for(members.len(), cfg.arena_slot_bytes);
            Arena::create(members.len(), cfg.arena_slot_bytes, 0, regions)?
        }
    };
    Ok(ArenaRole::Lead { arena, members })
}

/// Whether every rank of the group can read every other's memory directly,
/// so that collectives may send large buffers as their address to all ranks
/// at once (`Transport::single_copy_bytes`). Every rank decides the same:
/// only groups on one host, every rank offering it, take part in a vote of
/// what each found when it read every peer's published probe.
fn single_copy_group(
    store: &dyn Store,
    keys: &Keys,
    rank: usize,
    records: &[Published],
    timeout: Duration,
) -> Result<bool> {
    if !votes_on_single_copy(records) {
        return Ok(false);
    }
    let mut reads_all = true;
    for (peer, r) in records.iter().enumerate().filter(|&(p, _)| p != rank) {
        // Only once the peer has let its peers read it (at Yama scope 1).
        let what = format!("rank {rank} was waiting for rank {peer} to let its peers read its memory");
        wait_for(store, &keys.readable(peer), timeout, &what)?;
        reads_all &= r.shm.as_deref().is_some_and(may_read);
    }
    store.set(&keys.vote(rank), if reads_all { b"1" } else { b"0" })?;
    let mut all = true;
    for peer in 0..records.len() {
        let what = format!("rank {rank} was waiting for rank {peer}'s single-copy vote");
        let vote = wait_for(store, &keys.vote(peer), timeout, &what)?;
        all &= vote == b"1";
    }
    if !all {
        tracing::info!(
            "rustc10d: rank {rank}: some rank cannot read its peers' memory: collectives copy through the rings"
        );
    }
    Ok(all)
}

/// Whether the ranks vote on single copy (`single_copy_group`): all of them
/// offer it, on one known host. The same on every rank (it reads the records only).
fn votes_on_single_copy(records: &[Published]) -> bool {
    let host = &records[0].host;
    records.len() > 1
        && host != "unknown"
        && records.iter().all(|r| r.single_copy && r.shm.is_some() && &r.host == host)
}

/// Tell the other ranks that this one cannot take part (a bad setting, say),
/// so that they fail at once with `why` rather than at their timeout. Best
/// effort; sealed with the job's secret where there is one.
pub fn refuse(store: &dyn Store, me: &Member, secret: Option<&Secret>, why: &Error) {
    let store = &Sealed { store, secret };
    if let Ok(keys) = Keys::join(store, me.size.max(1)) {
        refuse_in(store, &keys, me.rank, why);
        settle(store, &keys, me.size, true, Instant::now() + me.timeout);
    }
}

fn refuse_in(store: &dyn Store, keys: &Keys, rank: usize, why: &Error) {
    let _ = store.set(&keys.addr(rank), format!("v{PROTOCOL_VERSION} refused {}", why.message).as_bytes());
}

/// At most this long, a rank that fails init for a reason every rank
/// learns from the Store waits for the others to have learnt it.
const LINGER: Duration = Duration::from_secs(5);

/// This rank fails init and is done with the Store. It may live in this
/// rank's process (env:// puts it in rank 0's), whose exit would take it
/// down before slower ranks have read why, leaving them only "the Store
/// failed". So a rank that fails for a reason the others read too
/// (`failed_with_them`: its refusal, a setting or protocol that differs)
/// waits, at most `LINGER`, until every rank has counted itself done here.
/// Every rank does fail then (a setting that differs differs for each rank
/// from some other), so ranks that succeed need not count. Best effort: a
/// Store that fails ends the wait.
fn settle(store: &dyn Store, keys: &Keys, size: usize, failed_with_them: bool, deadline: Instant) {
    let Ok(done) = store.add(&keys.settled(), 1) else { return };
    if done == size as i64 {
        let _ = store.set(&keys.all_settled(), b"1");
    }
    let wait = deadline.saturating_duration_since(Instant::now()).min(LINGER);
    if failed_with_them && done < size as i64 && !wait.is_zero() {
        let _ = store.get(&keys.all_settled(), wait);
    }
}

/// The Store keys of one incarnation of the group.
struct Keys(i64);

impl Keys {
    /// A process group re-created over the same Store (destroy, then init
    /// again) must not read the last incarnation's keys: every rank counts
    /// itself in, and the count tells which incarnation this is.
    fn join(store: &dyn Store, size: usize) -> Result<Keys> {
        let joined = store.add("rustc10d/joined", 1)?;
        Ok(Keys((joined - 1) / size as i64))
    }

    fn addr(&self, rank: usize) -> String {
        format!("rustc10d/{}/addr/{rank}", self.0)
    }
    fn readable(&self, rank: usize) -> String {
        format!("rustc10d/{}/readable/{rank}", self.0)
    }
    fn vote(&self, rank: usize) -> String {
        format!("rustc10d/{}/single-copy/{rank}", self.0)
    }
    fn settled(&self) -> String {
        format!("rustc10d/{}/settled", self.0)
    }
    fn all_settled(&self) -> String {
        format!("rustc10d/{}/settled/all", self.0)
    }
    fn read(&self) -> String {
        format!("rustc10d/{}/read", self.0)
    }

    /// This rank has read every key of the incarnation it will read: the
    /// last to say so deletes them, so that a job that re-forms its groups
    /// again and again (a reconfigure per quorum, a group per step with
    /// connections of its own) does not grow the Store by a record per rank
    /// each time, and the records (addresses, key shares) are there to read
    /// only while the ranks meet. The count of incarnations ("joined") and a
    /// reconfigure's count of members stay: they tell an incarnation or a
    /// uuid used before. Best effort: a Store that cannot delete keeps them.
    /// Only keys the records say were written are deleted (a round trip
    /// each); the settle keys are written only by ranks that fail before this.
    fn read_by(&self, store: &dyn Store, rank: usize, records: &[Published]) {
        if store.add(&self.read(), 1).ok() != Some(records.len() as i64) {
            return;
        }
        let voted = votes_on_single_copy(records);
        let per_rank = records.iter().enumerate().flat_map(|(r, record)| {
            let readable = record.single_copy.then(|| self.readable(r));
            [Some(self.addr(r)), readable, voted.then(|| self.vote(r))].into_iter().flatten()
        });
        for key in per_rank.chain([self.read()]) {
            if let Err(e) = store.delete(&key) {
                tracing::debug!("rustc10d: rank {rank} left {key} in the Store: {}", e.message);
                return;
            }
        }
    }
}

/// The value of `key` once some rank has set it. A Store that fails well
/// before `timeout` did not time out: its connection broke (the process
/// that hosts it may have exited), and the error says so.
fn wait_for(store: &dyn Store, key: &str, timeout: Duration, what: &str) -> Result<Vec<u8>> {
    let start = Instant::now();
    store.get(key, timeout).map_err(|e| {
        let after = start.elapsed();
        if after + after / 8 >= timeout {
            Error::timed_out(timeout, format_args!("{what}: {e}"))
        } else {
            let after = after.as_secs_f64();
            Error::io(format!(
                "rustc10d: {what}, and the Store failed after {after:.1} s (has the process that hosts it exited?): {e}"
            ))
        }
    })
}

/// `peer`'s record, once it is published, checked against this rank's:
/// the protocol, then the shared settings (before the rest, so that a rank
/// without the secret reading a sealed record is told that they differ).
fn lookup_peer(
    store: &dyn Store,
    keys: &Keys,
    cfg: &Config,
    rank: usize,
    peer: usize,
    timeout: Duration,
) -> Result<Published> {
    let what = format!("rank {rank} was waiting for rank {peer} to publish its address");
    let raw = wait_for(store, &keys.addr(peer), timeout, &what)?;
    let text = String::from_utf8_lossy(&raw);
    if let Some(why) = text.strip_prefix(&format!("v{PROTOCOL_VERSION} refused ")) {
        return Err(Error::aborted(format!("rustc10d: rank {peer} could not join the group: {why}")));
    }
    let version = text.split(' ').next().unwrap_or("");
    if version != format!("v{PROTOCOL_VERSION}") {
        return Err(Error::invalid(format!(
            "rustc10d: rank {peer} speaks protocol {version:?}, rank {rank} speaks v{PROTOCOL_VERSION}: all ranks must run the same rustc10d version"
        )));
    }
    if let Some(settings) = text.split(' ').nth(4) {
        cfg.check_shared(settings, rank, peer)?;
    }
    Published::decode(&text)
        .ok_or_else(|| Error::io(format!("rustc10d: rank {peer} published a malformed address {text:?}")))
}

/// The address to advertise: the forced interface's (`ifname`,
/// RUSTC10D_SOCKET_IFNAME), else the one that routes to the Store's host,
/// else the first non-loopback interface, else loopback. Never the
/// hostname's resolution, which Debian maps to 127.0.1.1.
pub fn choose_local_ip(ifname: Option<&str>, store_host: Option<&str>) -> Result<IpAddr> {
    if let Some(name) = ifname {
        return interface_addr(name);
    }
    let host = store_host.filter(|h| !h.is_empty()).map(str::to_string).or_else(|| std::env::var("MASTER_ADDR").ok());
    if let Some(ip) = host.as_deref().and_then(route_to) {
        return Ok(ip);
    }
    let others: Vec<IpAddr> = interfaces()?.into_iter().map(|(_, ip)| ip).filter(|ip| !ip.is_loopback()).collect();
    let first = others.iter().find(|ip| ip.is_ipv4()).or(others.first());
    Ok(first.copied().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

/// The local address the kernel would use to reach `host` (no packet is sent).
fn route_to(host: &str) -> Option<IpAddr> {
    let all: Vec<SocketAddr> = (host, 9).to_socket_addrs().ok()?.collect();
    let target = all.iter().find(|a| a.is_ipv4()).or(all.first())?;
    let sock = UdpSocket::bind(if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).ok()?;
    sock.connect(target).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

/// The interface's IPv4 address, else its global IPv6 one.
fn interface_addr(name: &str) -> Result<IpAddr> {
    let all = interfaces()?;
    let mine = || all.iter().filter(|(n, _)| n == name).map(|&(_, ip)| ip);
    if let Some(ip) = mine().find(IpAddr::is_ipv4).or_else(|| mine().next()) {
        return Ok(ip);
    }
    let mut names: Vec<_> = all.iter().map(|(n, _)| n.as_str()).collect();
    names.dedup();
    Err(Error::invalid(format!(
        "rustc10d: RUSTC10D_SOCKET_IFNAME={name}: no interface of that name with an IP address (have: {})",
        names.join(", ")
    )))
}

/// (name, address) of every interface that is up: IPv4, and IPv6 except
/// link-local (those need a scope id that peers would not know).
fn interfaces() -> Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes the head of a list it allocates into `head`, a
    // live local; the list is freed below, once.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::io(format!("rustc10d: getifaddrs failed: {}", std::io::Error::last_os_error())));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is non-null (the loop's condition) and a node of the list
        // getifaddrs made, which stays allocated until freeifaddrs below.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_flags & libc::IFF_UP as u32 == 0 || ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr is non-null (checked above) and points at a sockaddr of
        // the list, which stays allocated until freeifaddrs below.
        let ip = match unsafe { (*ifa.ifa_addr).sa_family } as i32 {
            libc::AF_INET => {
                // SAFETY: the address family is AF_INET, so getifaddrs allocated a whole sockaddr_in there.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: the address family is AF_INET6, so getifaddrs allocated a whole sockaddr_in6 there.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                if ip.segments()[0] & 0xffc0 == 0xfe80 {
                    continue;
                }
                IpAddr::V6(ip)
            }
            _ => continue,
        };
        // SAFETY: ifa_name is the interface's NUL-terminated name, which getifaddrs
        // always sets, alive until freeifaddrs below; it is copied out here.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        out.push((name, ip));
    }
    // SAFETY: `head` is the list getifaddrs returned, freed once; nothing of it
    // is used after (the names and addresses were copied).
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_store_host_gives_loopback() {
        assert_eq!(choose_local_ip(None, Some("127.0.0.1")).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    }

    #[test]
    fn ipv6_store_host_gives_ipv6() {
        if interfaces().unwrap().iter().any(|(_, ip)| *ip == IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)) {
            assert_eq!(choose_local_ip(None, Some("::1")).unwrap(), IpAddr::V6(std::net::Ipv6Addr::LOCALHOST));
        }
    }

    #[test]
    fn lo_is_listed() {
        assert!(interfaces().unwrap().iter().any(|(n, ip)| n == "lo" && ip.is_loopback()));
        assert!(interface_addr("lo").unwrap().is_ipv4(), "IPv4 first");
        assert!(interface_addr("nosuchif0").unwrap_err().message.contains("nosuchif0"));
    }

    #[test]
    fn version_mismatch_is_reported() {
        let store = MemStore::default();
        let keys = Keys(0);
        store.set(&keys.addr(1), b"v999 127.0.0.1:1").unwrap();
        store.set(&keys.addr(3), format!("v{PROTOCOL_VERSION} 127.0.0.1").as_bytes()).unwrap();
        let cfg = Config::default();
        let err = lookup_peer(&store, &keys, &cfg, 0, 3, Duration::from_millis(10)).unwrap_err();
        assert!(err.message.contains("malformed"), "{}", err.message);
        let p = Published {
            tcp: "[::1]:5".parse().unwrap(),
            host: "h".into(),
            shm: None,
            settings: "a=1,b=2".into(),
            single_copy: false,
            share: [0xA5; SHARE_LEN],
        };
        assert_eq!(Published::decode(&p.encode()), Some(p.clone()));
        let p = Published {
            shm: Some("rustc10d-ab".into()),
            single_copy: true,
            share: std::array::from_fn(|i| i as u8),
            ..p
        };
        assert_eq!(Published::decode(&p.encode()), Some(p.clone()));
        for bad in [" 00", "0", " extra"] {
            assert_eq!(Published::decode(&format!("{}{bad}", p.encode())), None, "{bad:?}");
        }
        let err = lookup_peer(&store, &keys, &cfg, 0, 1, Duration::from_millis(10)).unwrap_err();
        assert!(err.message.contains("v999") && err.message.contains("rank 1"), "{}", err.message);
        let err = lookup_peer(&store, &keys, &cfg, 0, 2, Duration::from_millis(10)).unwrap_err();
        assert!(err.message.contains("waiting for rank 2"), "{}", err.message);
    }

    #[test]
    fn hosts_are_numbered_by_their_lowest_rank_and_unknown_ones_stand_alone() {
        let on = |host: &str| Published {
            tcp: "127.0.0.1:1".parse().unwrap(),
            host: host.into(),
            shm: None,
            settings: String::new(),
            single_copy: false,
            share: [0; SHARE_LEN],
        };
        let records: Vec<Published> = ["b", "a", "b", "unknown", "a", "unknown"].into_iter().map(on).collect();
        assert_eq!(number_hosts(&records), [0, 1, 0, 2, 1, 3]);
    }

    /// A Store whose connection broke: every get fails at once.
    struct BrokenStore;

    impl Store for BrokenStore {
        fn set(&self, _: &str, _: &[u8]) -> Result<()> {
            Ok(())
        }
        fn add(&self, _: &str, _: i64) -> Result<i64> {
            Ok(0)
        }
        fn get(&self, key: &str, _: Duration) -> Result<Vec<u8>> {
            Err(Error::timeout(format!("store get {key}: Connection was likely closed")))
        }
        fn delete(&self, _: &str) -> Result<bool> {
            Ok(false)
        }
    }

    #[test]
    fn a_store_that_breaks_early_is_not_called_a_timeout() {
        let err = lookup_peer(&BrokenStore, &Keys(0), &Config::default(), 1, 0, Duration::from_secs(30)).unwrap_err();
        assert_eq!(err.kind, crate::error::ErrorKind::Io, "{}", err.message);
        assert!(!err.message.contains("Timed out"), "{}", err.message);
        for part in ["rank 1 was waiting for rank 0", "the Store failed after", "likely closed"] {
            assert!(err.message.contains(part), "{part}: {}", err.message);
        }
        let err = lookup_peer(&MemStore::default(), &Keys(0), &Config::default(), 1, 0, Duration::from_millis(20))
            .unwrap_err();
        assert!(err.message.contains("Timed out after 20 ms"), "{}", err.message);
    }
}
