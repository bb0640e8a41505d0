//! Every setting of a process group, in one place: built once per group from
//! the environment (`RUSTC10D_*`) and the options passed to
//! `init_process_group(pg_options=rustc10d.Options(...))` (which win), checked
//! there with an error naming the setting, then passed down explicitly. The
//! settings every rank must share travel with the rendezvous
//! (`Config::shared`), so ranks configured differently fail at init.

use crate::error::{Error, Result};
use crate::fault::Faults;
use crate::secret::Secret;
pub use crate::transport::links::striping::LaneCount;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// How ranks on the same host talk: shared memory where it can be set up
/// (else TCP), shared memory or fail at init, or TCP. Ranks on other hosts
/// always use TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportMode {
    Auto,
    Shm,
    Tcp,
}

/// What `Work.wait()` on a CUDA op does: block the host until the network
/// part is done (`Host`), or only order the caller's stream after the op's
/// copies back, which a word the engine writes holds (`Stream`, as NCCL's
/// wait does, for every op; see `engine::gates`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaWait {
    Host,
    Stream,
}

/// stderr log level of the engine's `tracing` output (process-wide).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

#[derive(Debug, Clone)]
pub struct Config {
    // Shared: every rank of the group must have the same value.
    /// Payload bytes per message in the pipelined algorithms.
    pub segment_bytes: usize,
    /// All-reduces up to this size use the direct exchange, not the ring.
    pub small_allreduce_bytes: usize,
    /// Bytes of each shared-memory ring (a power of two).
    pub shm_ring_bytes: usize,
    /// Staged (CUDA) all_reduce and broadcast above this run in pieces of it (0: whole).
    pub stage_piece_bytes: usize,
    /// Messages of at least this many bytes to a rank on this host are read
    /// by it straight from this rank's memory, where the kernel allows it (0:
    /// never); collectives choose their algorithms by it.
    pub single_copy_bytes: usize,
    /// Bytes of each of a rank's two slots in the group's shared arena,
    /// where every rank runs on one host (0: no arena).
    pub arena_slot_bytes: usize,
    /// The job's shared secret (secret.rs), given out of band; whether it is
    /// set is shared, the secret itself never leaves this process.
    pub secret: Option<Arc<Secret>>,
    /// Seal the frames of every TCP connection (seal.rs); needs the secret.
    pub encrypt: bool,
    // This rank's own.
    /// At Yama's ptrace_scope 1, while a group with single copy has a peer
    /// on this host, let every process of this user attach to this one
    /// (PR_SET_PTRACER_ANY), so that the peers can read its memory.
    pub ptracer_any: bool,
    /// Raise the soft limit on open files to the hard one at the first group.
    pub raise_fd_limit: bool,
    /// Most bytes of one peer's messages kept for receives not yet posted (mailbox.rs).
    pub early_bytes_max: u64,
    pub transport: TransportMode,
    /// TCP connections this rank sends to each peer on (`auto`: chosen by
    /// measuring, see `transport::striping`).
    pub nsocks: LaneCount,
    /// How long a waiter polls before it sleeps.
    pub spin: Duration,
    /// How long an op run on its caller's thread (`async_op=False`) polls
    /// for its peers before it sleeps: its caller waits anyway.
    pub sync_spin: Duration,
    /// The interface whose address this rank advertises.
    pub socket_ifname: Option<String>,
    pub faults: Arc<Faults>,
    /// CUDA tensors are accepted (staged through host memory).
    pub cuda: bool,
    pub cuda_wait: CudaWait,
    /// Tests only: CPU tensors are staged as CUDA tensors are (host memory as the device).
    pub test_staging: bool,
    /// Tests only: this rank pauses in its join, after its own dials and
    /// before it waits for its peers', as a rank the scheduler holds back.
    pub test_join_pause: Duration,
    pub log: LogLevel,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            segment_bytes: 1 << 20,
            small_allreduce_bytes: 16 << 10,
            // 1 MiB measured better than 2-16 MiB on the 2-core machine (the rings stay in cache).
            shm_ring_bytes: 1 << 20,
            stage_piece_bytes: 8 << 20,
            transport: TransportMode::Auto,
            nsocks: LaneCount::Auto,
            single_copy_bytes: 64 << 10,
            arena_slot_bytes: 1 << 20,
            secret: None,
            encrypt: false,
            ptracer_any: true,
            raise_fd_limit: true,
            early_bytes_max: crate::transport::links::mailbox::EARLY_BYTES_MAX,
            spin: Duration::from_micros(50),
            // Ranks called at once wake from their compute tens of microseconds
            // apart: polling that long costs less than a sleep and a wake-up
            // (measured: W=2 after 2 ms idle, 8 B, ~150 us at 50, ~60 us at 1000).
            sync_spin: Duration::from_micros(1000),
            socket_ifname: None,
            faults: Arc::default(),
            cuda: true,
            cuda_wait: CudaWait::Host,
            test_staging: false,
            test_join_pause: Duration::ZERO,
            log: LogLevel::Warn,
        }
    }
}

/// One setting: its option name (`rustc10d.Options` field) and its variable.
struct Setting {
    option: &'static str,
    env: &'static str,
    shared: bool,
    set: fn(&mut Config, &str) -> std::result::Result<(), String>,
    show: fn(&Config) -> String,
}

/// The table of every setting; README's "Settings" lists the same.
const SETTINGS: &[Setting] = &[
    Setting {
        option: "segment_bytes",
        env: "RUSTC10D_SEGMENT_BYTES",
        shared: true,
        set: |c, v| {
            c.segment_bytes = bytes(v, 1, 1 << 30)?;
            Ok(())
        },
        show: |c| c.segment_bytes.to_string(),
    },
    Setting {
        option: "small_allreduce_bytes",
        env: "RUSTC10D_SMALL_ALLREDUCE_BYTES",
        shared: true,
        set: |c, v| {
            c.small_allreduce_bytes = bytes(v, 0, 1 << 30)?;
            Ok(())
        },
        show: |c| c.small_allreduce_bytes.to_string(),
    },
    Setting {
        option: "shm_ring_bytes",
        env: "RUSTC10D_SHM_RING_BYTES",
        shared: true,
        set: |c, v| {
            let n = bytes(v, 64 << 10, 1 << 30)?;
            if !n.is_power_of_two() {
                return Err(format!("{n} is not a power of two"));
            }
            c.shm_ring_bytes = n;
            Ok(())
        },
        show: |c| c.shm_ring_bytes.to_string(),
    },
    Setting {
        option: "stage_piece_bytes",
        env: "RUSTC10D_STAGE_PIECE_BYTES",
        shared: true,
        set: |c, v| {
            c.stage_piece_bytes = bytes(v, 0, usize::MAX)?;
            Ok(())
        },
        show: |c| c.stage_piece_bytes.to_string(),
    },
    Setting {
        option: "single_copy_bytes",
        env: "RUSTC10D_SINGLE_COPY_BYTES",
        shared: true,
        set: |c, v| {
            c.single_copy_bytes = bytes(v, 0, usize::MAX)?;
            Ok(())
        },
        show: |c| c.single_copy_bytes.to_string(),
    },
    Setting {
        option: "arena_slot_bytes",
        env: "RUSTC10D_ARENA_SLOT_BYTES",
        shared: true,
        set: |c, v| {
            let n = bytes(v, 0, 1 << 30)?;
            if n % 4096 != 0 || (n > 0 && n < 4096) {
                return Err(format!("{n} is not 0 or a multiple of 4096"));
            }
            c.arena_slot_bytes = n;
            Ok(())
        },
        show: |c| c.arena_slot_bytes.to_string(),
    },
    Setting {
        option: "secret",
        env: "RUSTC10D_SECRET",
        shared: true,
        set: |c, v| {
            c.secret = Some(Arc::new(Secret::new(v)?));
            Ok(())
        },
        show: |c| if c.secret.is_some() { "on" } else { "off" }.to_string(),
    },
    Setting {
        option: "secret_file",
        env: "RUSTC10D_SECRET_FILE",
        shared: false,
        set: |c, v| {
            c.secret = Some(Arc::new(Secret::from_file(v)?));
            Ok(())
        },
        show: |_| String::new(),
    },
    Setting {
        option: "encrypt",
        env: "RUSTC10D_ENCRYPT",
        shared: true,
        set: |c, v| {
            c.encrypt = flag(v)?;
            Ok(())
        },
        show: |c| u8::from(c.encrypt).to_string(),
    },
    Setting {
        option: "ptracer_any",
        env: "RUSTC10D_PTRACER_ANY",
        shared: false,
        set: |c, v| {
            c.ptracer_any = flag(v)?;
            Ok(())
        },
        show: |c| u8::from(c.ptracer_any).to_string(),
    },
    Setting {
        option: "early_bytes_max",
        env: "RUSTC10D_EARLY_BYTES_MAX",
        shared: false,
        set: |c, v| {
            c.early_bytes_max = bytes(v, 0, usize::MAX)? as u64;
            Ok(())
        },
        show: |c| c.early_bytes_max.to_string(),
    },
    Setting {
        option: "raise_fd_limit",
        env: "RUSTC10D_RAISE_FD_LIMIT",
        shared: false,
        set: |c, v| {
            c.raise_fd_limit = flag(v)?;
            Ok(())
        },
        show: |c| u8::from(c.raise_fd_limit).to_string(),
    },
    Setting {
        option: "transport",
        env: "RUSTC10D_TRANSPORT",
        shared: false,
        set: |c, v| {
            c.transport = match v.to_ascii_lowercase().as_str() {
                "auto" => TransportMode::Auto,
                "shm" => TransportMode::Shm,
                "tcp" => TransportMode::Tcp,
                _ => return Err("expected auto, shm or tcp".into()),
            };
            Ok(())
        },
        show: |c| format!("{:?}", c.transport).to_ascii_lowercase(),
    },
    Setting {
        option: "nsocks",
        env: "RUSTC10D_NSOCKS",
        shared: false,
        set: |c, v| {
            c.nsocks = match v.to_ascii_lowercase().as_str() {
                "auto" => LaneCount::Auto,
                _ => LaneCount::Fixed(number(v, 1, 16).map_err(|_| "expected auto or a number from 1 to 16")? as usize),
            };
            Ok(())
        },
        show: |c| match c.nsocks {
            LaneCount::Auto => "auto".to_string(),
            LaneCount::Fixed(n) => n.to_string(),
        },
    },
    Setting {
        option: "spin_us",
        env: "RUSTC10D_SPIN_US",
        shared: false,
        set: |c, v| {
            c.spin = Duration::from_micros(number(v, 0, 1_000_000)?);
            Ok(())
        },
        show: |c| c.spin.as_micros().to_string(),
    },
    Setting {
        option: "sync_spin_us",
        env: "RUSTC10D_SYNC_SPIN_US",
        shared: false,
        set: |c, v| {
            c.sync_spin = Duration::from_micros(number(v, 0, 1_000_000)?);
            Ok(())
        },
        show: |c| c.sync_spin.as_micros().to_string(),
    },
    Setting {
        option: "socket_ifname",
        env: "RUSTC10D_SOCKET_IFNAME",
        shared: false,
        set: |c, v| {
            if v.is_empty() {
                return Err("expected an interface name".into());
            }
            c.socket_ifname = Some(v.to_string());
            Ok(())
        },
        show: |c| c.socket_ifname.clone().unwrap_or_default(),
    },
    Setting {
        option: "fault",
        env: "RUSTC10D_FAULT",
        shared: false,
        set: |c, v| {
            c.faults = Arc::new(Faults::parse(v)?);
            Ok(())
        },
        show: |_| String::new(),
    },
    Setting {
        option: "cuda",
        env: "RUSTC10D_CUDA",
        shared: false,
        set: |c, v| {
            c.cuda = flag(v)?;
            Ok(())
        },
        show: |c| u8::from(c.cuda).to_string(),
    },
    Setting {
        option: "cuda_wait",
        env: "RUSTC10D_CUDA_WAIT",
        shared: false,
        set: |c, v| {
            c.cuda_wait = match v {
                "host" => CudaWait::Host,
                "stream" => CudaWait::Stream,
                _ => return Err("expected host or stream".into()),
            };
            Ok(())
        },
        show: |c| format!("{:?}", c.cuda_wait).to_ascii_lowercase(),
    },
    Setting {
        option: "test_staging",
        env: "RUSTC10D_TEST_STAGING",
        shared: false,
        set: |c, v| {
            c.test_staging = flag(v)?;
            Ok(())
        },
        show: |c| u8::from(c.test_staging).to_string(),
    },
    Setting {
        option: "test_join_pause_ms",
        env: "RUSTC10D_TEST_JOIN_PAUSE_MS",
        shared: false,
        set: |c, v| {
            c.test_join_pause = Duration::from_millis(number(v, 0, 60_000)?);
            Ok(())
        },
        show: |c| c.test_join_pause.as_millis().to_string(),
    },
    Setting {
        option: "log",
        env: "RUSTC10D_LOG",
        shared: false,
        set: |c, v| {
            c.log = log_level(v)?;
            Ok(())
        },
        show: |c| format!("{:?}", c.log).to_ascii_lowercase(),
    },
];

impl Config {
    /// The group's settings: defaults, then the environment (`env` looks a
    /// variable up), then `options` (name -> value, from rustc10d.Options).
    pub fn build(env: impl Fn(&str) -> Option<String>, options: &BTreeMap<String, String>) -> Result<Config> {
        let mut cfg = Config::default();
        for s in SETTINGS {
            if let Some(v) = env(s.env) {
                let v = v.trim();
                if !v.is_empty() {
                    let shown = if s.option == "secret" { "(hidden)" } else { v };
                    (s.set)(&mut cfg, v).map_err(|why| bad(format_args!("{}={shown:?}", s.env), why))?;
                }
            }
        }
        for (name, v) in options {
            let s = SETTINGS.iter().find(|s| s.option == name).ok_or_else(|| {
                let known: Vec<_> = SETTINGS.iter().map(|s| s.option).collect();
                Error::invalid(format!(
                    "rustc10d: rustc10d.Options has no setting {name:?} (it has {})",
                    known.join(", ")
                ))
            })?;
            let shown = if s.option == "secret" { "(hidden)" } else { v };
            (s.set)(&mut cfg, v.trim()).map_err(|why| bad(format_args!("rustc10d.Options({name}={shown:?})"), why))?;
        }
        if cfg.encrypt && cfg.secret.is_none() {
            // Without it the keys derive from what the Store holds: sealing would hide nothing from
            // whoever can read the Store.
            return Err(Error::invalid(
                "rustc10d: RUSTC10D_ENCRYPT=1 needs the job's secret (RUSTC10D_SECRET or RUSTC10D_SECRET_FILE): \
                 without it, whoever can read the Store could derive the keys",
            ));
        }
        Ok(cfg)
    }

    /// The job's secret alone, from the environment: what a rank whose other
    /// settings are bad seals its refusal with (None: none, or a bad one).
    pub fn secret_from_env() -> Option<Arc<Secret>> {
        let secret_vars = |k: &str| k.starts_with("RUSTC10D_SECRET").then(|| std::env::var(k).ok()).flatten();
        Config::build(secret_vars, &BTreeMap::new()).ok()?.secret
    }

    /// From the process environment and `options`.
    pub fn from_env(options: &BTreeMap<String, String>) -> Result<Config> {
        Config::build(|k| std::env::var(k).ok(), options)
    }

    /// The settings every rank must share, as `name=value` pairs for the rendezvous.
    pub fn shared(&self) -> String {
        SETTINGS
            .iter()
            .filter(|s| s.shared)
            .map(|s| format!("{}={}", s.option, (s.show)(self)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Compare a peer's `shared()` with ours: an error naming the first setting that differs.
    pub fn check_shared(&self, theirs: &str, rank: usize, peer: usize) -> Result<()> {
        let mine = self.shared();
        if mine == theirs {
            return Ok(());
        }
        let parse = |s: &str| -> BTreeMap<String, String> {
            s.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let (mine, theirs) = (parse(&mine), parse(theirs));
        let differs = SETTINGS.iter().filter(|s| s.shared).find(|s| mine.get(s.option) != theirs.get(s.option));
        let (option, env) = differs.map_or(("settings", "?"), |s| (s.option, s.env));
        let show = |m: &BTreeMap<String, String>| m.get(option).cloned().unwrap_or_else(|| "(not set)".into());
        Err(Error::invalid(format!(
            "rustc10d: rank {rank} and rank {peer} disagree on {option} ({env}): {} on rank {rank}, {} on rank {peer}; \
             every rank of a group must use the same value",
            show(&mine),
            show(&theirs)
        )))
    }
}

fn bad(what: std::fmt::Arguments, why: impl std::fmt::Display) -> Error {
    Error::invalid(format!("rustc10d: {what}: {why}"))
}

fn number(v: &str, min: u64, max: u64) -> std::result::Result<u64, String> {
    let n: u64 = v.parse().map_err(|_| format!("expected a whole number from {min} to {max}"))?;
    if n < min || n > max {
        return Err(format!("{n} is out of range ({min} to {max})"));
    }
    Ok(n)
}

fn bytes(v: &str, min: usize, max: usize) -> std::result::Result<usize, String> {
    Ok(number(v, min as u64, max as u64)? as usize)
}

fn flag(v: &str) -> std::result::Result<bool, String> {
    match v {
        "1" | "true" | "True" => Ok(true),
        "0" | "false" | "False" => Ok(false),
        _ => Err("expected 0 or 1".into()),
    }
}

pub fn log_level(v: &str) -> std::result::Result<LogLevel, String> {
    Ok(match v.to_ascii_lowercase().as_str() {
        "error" => LogLevel::Error,
        "warn" | "warning" => LogLevel::Warn,
        "info" => LogLevel::Info,
        "debug" => LogLevel::Debug,
        "trace" => LogLevel::Trace,
        _ => return Err("expected error, warn, info, debug or trace".into()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    fn options(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_then_environment_then_options() {
        let cfg = Config::build(env(&[]), &BTreeMap::new()).unwrap();
        assert_eq!((cfg.segment_bytes, cfg.nsocks, cfg.cuda), (1 << 20, LaneCount::Auto, true));
        let vars = [("RUSTC10D_SEGMENT_BYTES", "65536"), ("RUSTC10D_NSOCKS", "3"), ("RUSTC10D_CUDA", "0")];
        let cfg = Config::build(env(&vars), &options(&[("segment_bytes", "4096")])).unwrap();
        assert_eq!(
            (cfg.segment_bytes, cfg.nsocks, cfg.cuda),
            (4096, LaneCount::Fixed(3), false),
            "options win over the environment"
        );
        assert_eq!(cfg.transport, TransportMode::Auto);
    }

    #[test]
    fn bad_values_name_the_setting_and_the_value() {
        let cases = [
            (("RUSTC10D_SEGMENT_BYTES", "lots"), "RUSTC10D_SEGMENT_BYTES=\"lots\": expected a whole number"),
            (("RUSTC10D_SEGMENT_BYTES", "0"), "0 is out of range"),
            (("RUSTC10D_SHM_RING_BYTES", "100000"), "100000 is not a power of two"),
            (("RUSTC10D_NSOCKS", "17"), "RUSTC10D_NSOCKS=\"17\": expected auto or a number from 1 to 16"),
            (("RUSTC10D_TRANSPORT", "udp"), "expected auto, shm or tcp"),
            (("RUSTC10D_CUDA", "yes"), "RUSTC10D_CUDA=\"yes\": expected 0 or 1"),
            (("RUSTC10D_PTRACER_ANY", "any"), "RUSTC10D_PTRACER_ANY=\"any\": expected 0 or 1"),
            (("RUSTC10D_CUDA_WAIT", "later"), "RUSTC10D_CUDA_WAIT=\"later\": expected host or stream"),
            (("RUSTC10D_LOG", "loud"), "expected error, warn"),
            (("RUSTC10D_FAULT", "op=allreduse,action=fail"), "unknown op \"allreduse\""),
        ];
        for ((k, v), want) in cases {
            let err = Config::build(env(&[(k, v)]), &BTreeMap::new()).unwrap_err();
            assert!(err.message.contains(want), "{k}={v}: {}", err.message);
        }
        let err = Config::build(env(&[]), &options(&[("segment_byte", "1")])).unwrap_err();
        assert!(err.message.contains("no setting \"segment_byte\""), "{}", err.message);
        let err = Config::build(env(&[]), &options(&[("nsocks", "0")])).unwrap_err();
        assert!(err.message.contains("rustc10d.Options(nsocks=\"0\")"), "{}", err.message);
    }

    #[test]
    fn shared_settings_are_compared_by_name() {
        let a = Config::default();
        let b = Config { small_allreduce_bytes: 1, nsocks: LaneCount::Fixed(4), ..Config::default() };
        let c = Config { nsocks: LaneCount::Fixed(4), ..Config::default() };
        a.check_shared(&c.shared(), 0, 1).unwrap();
        let err = a.check_shared(&b.shared(), 0, 2).unwrap_err();
        assert!(
            err.message.contains(
                "rank 0 and rank 2 disagree on small_allreduce_bytes (RUSTC10D_SMALL_ALLREDUCE_BYTES): 16384 on rank 0, 1 on rank 2"
            ),
            "{}",
            err.message
        );
    }
}
