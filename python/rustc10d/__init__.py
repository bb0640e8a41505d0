"""rustc10d: a torch.distributed backend written in Rust.

Importing this package registers the backend ``"rustc10d"`` for CPU and CUDA
tensors::

    import torch.distributed as dist
    import rustc10d  # optional on torch releases that find backends by entry point (2.15; not 2.11)
    dist.init_process_group(backend="rustc10d")
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import itertools
import json
import shlex
import sys
import urllib.parse
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def _rebuild_command() -> str:
    """The command that rebuilds this install against the torch installed now: pip recorded
    where it was built from (PEP 610's direct_url.json)."""
    source = "<your rustc10d checkout>"
    try:
        url = json.loads(importlib.metadata.distribution("rustc10d").read_text("direct_url.json") or "{}").get("url", "")
        if url.startswith("file://"):
            source = shlex.quote(urllib.parse.unquote(url.removeprefix("file://")))
    except (importlib.metadata.PackageNotFoundError, ValueError):
        pass
    return f"{shlex.quote(sys.executable)} -m pip install --no-build-isolation --force-reinstall --no-deps {source}"


# The C++ ABI differs between torch releases: the core is built once, and the torch side (the
# shim) once per release; _load picks the one for the torch installed now.
from . import _load

_native, BUILT_FOR_TORCH, TORCH_FEATURES = _load.load(_rebuild_command())
#: The torch version the loaded shim was built against (the installed torch's release).
BUILT_FOR_TORCH: str
#: Which of the torch APIs that differ across releases the loaded shim found ({name: bool}).
TORCH_FEATURES: dict[str, bool]

__version__: str = _native.__version__
BACKEND_NAME = "rustc10d"
__all__ = ["BACKEND_NAME", "Options", "all_reduce_", "all_reducer", "connections", "links", "reconfigurable_group",
           "register", "stats"]


@dataclasses.dataclass(frozen=True)
class Options:
    """Settings of one process group, for ``init_process_group(backend="rustc10d",
    pg_options=rustc10d.Options(...))`` or ``new_group(..., pg_options=...)``. A field left
    None takes its ``RUSTC10D_*`` environment variable, else the default; a given field wins
    over the variable. Bad values fail ``init_process_group`` naming the setting. The first
    seven must be the same on every rank of a group: a difference fails init on every rank.
    """

    #: Bytes per message in the pipelined algorithms (RUSTC10D_SEGMENT_BYTES; 1 MiB). Shared.
    segment_bytes: int | None = None
    #: All-reduces up to this size use one direct exchange (RUSTC10D_SMALL_ALLREDUCE_BYTES; 16 KiB). Shared.
    small_allreduce_bytes: int | None = None
    #: Bytes of each shared-memory ring, a power of two (RUSTC10D_SHM_RING_BYTES; 1 MiB). Shared.
    shm_ring_bytes: int | None = None
    #: CUDA all_reduce/broadcast above this run in pieces of it; 0: whole (RUSTC10D_STAGE_PIECE_BYTES; 8 MiB). Shared.
    stage_piece_bytes: int | None = None
    #: Messages of at least this many bytes to a rank on this host are read by it straight from
    #: this rank's memory where the kernel allows it, one copy instead of two, and collectives of
    #: blocks that large take one or two steps where every rank can (see ptracer_any); 0:
    #: never (RUSTC10D_SINGLE_COPY_BYTES; 64 KiB). Shared.
    single_copy_bytes: int | None = None
    #: Bytes of each of a rank's two slots in the shared arena of a group whose ranks all run
    #: on one host, where its collectives run (but those that take single copy); 0 or a
    #: multiple of 4096; 0: no arena (RUSTC10D_ARENA_SLOT_BYTES; 1 MiB). Shared.
    arena_slot_bytes: int | None = None
    #: Seal the frames of every TCP connection (AES-256-GCM, keys new with each connection), so
    #: that nobody on the path between hosts can read or change them; needs the job's secret
    #: (RUSTC10D_SECRET or RUSTC10D_SECRET_FILE). Shared memory is never sealed: no wire
    #: (RUSTC10D_ENCRYPT; False). Shared.
    encrypt: bool | None = None
    #: "auto", "shm" or "tcp" between ranks of one host (RUSTC10D_TRANSPORT; "auto").
    transport: str | None = None
    #: TCP connections collectives send to each peer on, 1 to 16, or "auto": measured per peer,
    #: 1 doubled up to 8 while that makes large sends a fifth faster (RUSTC10D_NSOCKS; "auto").
    nsocks: int | str | None = None
    #: Microseconds a waiter polls before it sleeps (RUSTC10D_SPIN_US; 50).
    spin_us: int | None = None
    #: Microseconds an op run on its caller's thread (async_op=False) polls for its peers before
    #: it sleeps (RUSTC10D_SYNC_SPIN_US; 1000).
    sync_spin_us: int | None = None
    #: At Yama ptrace_scope 1, while a group with single copy has a peer on this host, let every
    #: process of this user ptrace-attach to this one (PR_SET_PTRACER_ANY: read and write its
    #: memory and registers), so that the peers can read it; undone with the last such group.
    #: False: never, and single copy only where Yama already allows it (RUSTC10D_PTRACER_ANY; True).
    ptracer_any: bool | None = None
    #: Most bytes of one peer's messages kept in memory for receives not yet posted; past it,
    #: the peer's connections are read no further until a receive takes some (a peer that
    #: floods is held back, not stored; a program that posts its receives in another order
    #: than its peer sends, past this much, times out naming the peer) (RUSTC10D_EARLY_BYTES_MAX; 1 GiB).
    early_bytes_max: int | None = None
    #: The interface whose address this rank advertises (RUSTC10D_SOCKET_IFNAME).
    socket_ifname: str | None = None
    #: Fault injection rules (RUSTC10D_FAULT; see the README).
    fault: str | None = None
    #: False refuses CUDA tensors (RUSTC10D_CUDA; True).
    cuda: bool | None = None
    #: What Work.wait() on a CUDA collective does: "host" blocks the calling thread until the
    #: network part is done; "stream" returns at once and makes the caller's current stream
    #: wait for the results, as NCCL's does (RUSTC10D_CUDA_WAIT; "host", see the README).
    cuda_wait: str | None = None
    #: For ``new_group``: False gives the group connections of its own (and, on one host, a
    #: shared arena of its own) instead of a channel on the default group's connections; so does
    #: any other field given. Every rank must give a group the same options. None: share.
    share_connections: bool | None = None

    def _given(self) -> dict[str, str]:
        """The settings given, as text for the engine (share_connections is for Python alone)."""
        def text(v: object) -> str:
            return str(int(v)) if isinstance(v, bool) else str(v)

        fields = (f.name for f in dataclasses.fields(self) if f.name != "share_connections")
        return {name: text(getattr(self, name)) for name in fields if getattr(self, name) is not None}

    def _shares(self) -> bool:
        return self.share_connections is not False and not self._given()


def _millis(t: timedelta) -> int:
    """Whole milliseconds, rounded up, so that a tiny timeout never becomes zero."""
    return -(-t // timedelta(milliseconds=1))


def _settings(options: object | None, what: str) -> dict[str, str]:
    """The settings `options` gives, as text for the engine; `what` names the argument in the error."""
    if options is None:
        return {}
    if not isinstance(options, Options):
        raise TypeError(f"{what} must be rustc10d.Options, got {type(options).__name__}")
    return options._given()


def _create_backend(opts: dist.distributed_c10d._DistributedBackendOptions, backend_options: object | None):
    given = _settings(backend_options, "rustc10d: pg_options")
    timeout = _millis(opts.timeout)
    # A group made after the default one (new_group) sends over the default group's connections,
    # in a channel of its own, where that group is a live rustc10d group; one given settings of
    # its own (pg_options) opens connections of its own.
    world = dist.group.WORLD if dist.is_initialized() else None
    shares = backend_options is None or backend_options._shares()
    share = world.group_name if world is not None and shares and opts.group_id else ""
    members = list(getattr(opts, "global_ranks_in_group", None) or []) if share else []
    # init_process_group(..., enable_reconfigure=True) (torch 2.14 on): no members until the first
    # dist._reconfigure.
    unformed = bool(getattr(opts, "enable_reconfigure", False))
    return _native.create_backend(opts.store, opts.group_rank, opts.group_size, timeout, opts.group_id or "", given,
                                  share, members, unformed)


_reconfigurable_groups = itertools.count(1)  # names them


def reconfigurable_group(store: dist.Store, timeout: timedelta = timedelta(seconds=60),
                         options: Options | None = None) -> dist.ProcessGroup:
    """A rustc10d process group outside torch's group registry that has no members until its
    first ``reconfigure``: the native group that torchft's ``Manager(pg=...)`` takes across
    replica groups (torch 2.14 on), as ``dist.ProcessGroupGloo(..., enable_reconfigure=True)``
    is for Gloo::

        store = dist.PrefixStore(f"rustc10d/{group_rank}", dist.TCPStore(host, port, is_master=False))
        manager = torchft.Manager(pg=rustc10d.reconfigurable_group(store), ...)

    Each ``reconfigure`` (the Manager's, at every new quorum) meets through ``store``, so every
    process that may ever join this group, a replacement started later included, must be given
    a Store that reaches the same server under the same prefix: one the job's launcher hosts,
    not one of a replica group's own (the replica ranks that share a group rank share one
    prefix). The group serves CPU and CUDA tensors; ``timeout`` bounds every op and each
    reconfigure's rendezvous unless the reconfigure gives its own; ``options`` as for
    ``init_process_group``."""
    if not hasattr(dist.ProcessGroup, "reconfigure"):
        raise RuntimeError(f"rustc10d.reconfigurable_group: torch {torch.__version__} has no process group "
                           "reconfigure (torch 2.14 on)")
    given = _settings(options, "rustc10d.reconfigurable_group: options")
    backend = _native.create_backend(store, 0, 1, _millis(timeout), "", given, "", [], True)
    pg = dist.ProcessGroup(store, 0, 1)
    pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    for device in ("cpu", "cuda"):
        pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend)
    # A name of its own, so that each re-formed group is told apart in logs and rustc10d.stats.
    pg._set_group_name(f"rustc10d_reconfigurable_{next(_reconfigurable_groups)}")
    return pg


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place over a rustc10d group (default: the world group) and
    return it, as ``dist.all_reduce(tensor, op, group)`` does with ``async_op=False``, in one
    call of the torch op ``torch.ops.rustc10d.all_reduce_(tensor, group.group_name, int(op))``
    and no Work: for code that makes many small all_reduces, such as tensor-parallel inference
    (two per layer per token). A contiguous CPU tensor is reduced where it lies, on the
    caller's thread where nothing else of the group is pending; any other tensor takes
    ``dist.all_reduce``'s way. Every rank of the group must call it, in the same order as the
    group's other collectives. Raises as ``dist.all_reduce`` does; ``op`` is any but
    PREMUL_SUM. Hot loops may call the torch op directly with the group's name."""
    group = group if group is not None else dist.group.WORLD
    return torch.ops.rustc10d.all_reduce_(tensor, group.group_name, int(op))


def all_reducer(op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                group: dist.ProcessGroup | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``all_reduce_`` bound to ``op`` and a rustc10d ``group`` (default: the world group): a
    callable that takes the tensor alone and does what ``all_reduce_(tensor, op, group)`` does,
    without the dispatcher, for the hottest loops of small all_reduces in eager mode::

        reduce = rustc10d.all_reducer(group=tp_group)
        for layer in layers:
            ...
            reduce(hidden)  # in place, returns it

    torch.ops turns each argument of a torch op into a boxed value and runs torch's fallbacks
    over them: at W=2, 8 bytes, after 2 ms idle that was 14-18 us of the torch op's 23-28. Under
    torch.compile use ``all_reduce_``, which the compiler can trace. The callable is bound to the
    group's rustc10d backend for CPU tensors and hands it every tensor (a CUDA one is staged, as
    ``all_reduce_`` stages it on a group whose CUDA backend is rustc10d). It keeps that backend
    alive; on a destroyed group it raises as the op does."""
    group = group if group is not None else dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    # The shim adds both classes to this module when it makes its first backend.
    ours, reducer = globals().get("_Backend"), globals().get("_AllReducer")
    if ours is None or not isinstance(backend, ours):
        raise RuntimeError(f"rustc10d.all_reducer: the backend of group {group.group_name} for CPU tensors is "
                         f"{type(backend).__name__}, not rustc10d")
    return reducer(backend, int(op))


def stats(group: dist.ProcessGroup | None = None) -> dict[str, dict[str, float]]:
    """Per-op counters of a rustc10d group (default: the world group), on this rank.

    Returns ``{op: {"count", "failed", "bytes", "seconds", "max_seconds", "copied_bytes",
    "wakeups", "early_bytes"}}`` for every op kind that has finished at least once, e.g.
    ``stats()["allreduce"]["seconds"]``. ``copied_bytes`` counts the bytes this rank's CPU
    moved for those ops through copies and folds (shared-memory ring writes and reads, socket
    writes and reads, reads of a peer's memory, copies between buffers, reductions), and
    ``wakeups`` how often a thread waiting for them went to sleep: costs that, unlike times,
    do not depend on the machine. ``early_bytes`` counts the bytes that arrived before their
    receive was posted and waited in memory for it, each one copy more.
    """
    pg = group if group is not None else dist.group.WORLD
    return _native.stats(pg.group_name)


def links(group: dist.ProcessGroup | None = None) -> dict[int, str]:
    """How this rank reaches each peer of a rustc10d group it has connected with so far:
    ``{peer group rank: "shm" | "tcp"}`` (shared memory on the same host, TCP otherwise; see
    RUSTC10D_TRANSPORT). Connections open on first use, so an idle peer may be missing.
    """
    pg = group if group is not None else dist.group.WORLD
    return _native.links(pg.group_name)


def connections(group: dist.ProcessGroup | None = None) -> dict[int, int]:
    """How many connections this rank's collectives send to each peer of a rustc10d group on
    now: ``{peer group rank: count}`` for the peers it has connected with so far (1 for shared
    memory; for TCP, ``nsocks``, which with ``"auto"`` grows as this rank measures its large
    sends to that peer). Point-to-point ops keep to the first, so that they stay in order.
    """
    pg = group if group is not None else dist.group.WORLD
    return _native.connections(pg.group_name)


def register() -> None:
    """Register the backend with torch.distributed (idempotent; also the entry point)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


register()
