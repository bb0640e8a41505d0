"""A test bed of several "hosts" on one Linux machine, for tests and the benchmark.

Each host is a network namespace whose only link, ``rc0``, is one end of a veth pair; the other
end is a port of a Linux bridge in a "switch" namespace of its own. So ranks in different hosts
see different IP addresses and reach each other only through that link, as on real machines,
and ranks in the same host share its network namespace (and so, for rustc10d, shared memory).
With ``link_gbit`` every link is capped in both directions by a token bucket (``tc qdisc ...
tbf``): host side ``rc0`` egress is what the host sends, the switch port's egress what it
receives. Needs root and iproute2 (``ip``; ``tc`` for a cap)::

    from rustc10d.testbed import Hosts, TestbedUnavailable

    with Hosts(2, link_gbit=2) as hosts:          # raises TestbedUnavailable if it cannot
        argv = hosts.command(1, ["python", "job.py"])  # ["ip", "netns", "exec", NS, "python", ...]
        print(hosts.addrs[0], hosts.tx_bytes(1))
        print(hosts.throughput_gbit(0, 1))        # about 2.0

The interface has the same name in every host, so ``GLOO_SOCKET_IFNAME=rc0`` and
``RUSTC10D_SOCKET_IFNAME=rc0`` work for every rank. Addresses are ``10.213.N.(h+1)/24`` with a
random N, and namespace names carry a random tag, so concurrent test beds do not clash. Leaving
the ``with`` block (also on an error) kills whatever still runs in its namespaces and deletes
them. IPv6 is off in every namespace, so the links carry no traffic but what runs there (and
ARP). Every command has a timeout.
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType

__all__ = ["Hosts", "TestbedError", "TestbedUnavailable"]

IFNAME = "rc0"  # each host's link, the same name in every host
SUBNET = "10.213.{}.{}"  # private addresses that exist only inside the test bed's namespaces
TBF_LATENCY = "50ms"  # how long a packet may wait in a capped link's queue before it is dropped


class TestbedError(RuntimeError):
    """A command on the test bed failed (its argv and stderr are in the message)."""


class TestbedUnavailable(TestbedError):
    """The test bed cannot be built here: not root, no iproute2, or the kernel refused a
    namespace, a veth, a bridge or a qdisc. Tests skip on it."""


def _run(argv: Sequence[str], timeout: float) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TestbedError(f"{' '.join(argv)}: {e}") from e
    if done.returncode != 0:
        raise TestbedError(f"{' '.join(argv)}: exit code {done.returncode}: {done.stderr.strip()}")
    return done.stdout


class Hosts:
    """``count`` host namespaces joined by a bridge; see the module's doc. Use as a context
    manager (or call ``start()`` and ``close()``). ``names[h]`` is host h's namespace,
    ``addrs[h]`` its address on rc0, ``switch`` the bridge's namespace."""

    def __init__(self, count: int, link_gbit: float | None = None, mtu: int = 9000, timeout: float = 10.0):
        if not 1 <= count <= 250:
            raise ValueError(f"count must be 1 to 250, not {count}")
        if link_gbit is not None and not link_gbit > 0:
            raise ValueError(f"link_gbit must be positive, not {link_gbit}")
        if not 1280 <= mtu <= 65535:
            raise ValueError(f"mtu must be 1280 to 65535, not {mtu}")
        self.count, self.link_gbit, self.mtu, self.timeout = count, link_gbit, mtu, timeout
        tag = secrets.token_hex(3)
        net = 1 + secrets.randbelow(254)
        self.switch = f"rc10d-{tag}-sw"
        self.names: list[str] = [f"rc10d-{tag}-h{h}" for h in range(count)]
        self.addrs: list[str] = [SUBNET.format(net, h + 1) for h in range(count)]
        self._made: list[str] = []  # namespaces created so far, deleted by close()

    # -- building and tearing down -------------------------------------------------------------

    def __enter__(self) -> Hosts:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        """Build the test bed; raises TestbedUnavailable (after undoing what was built) if the
        machine does not allow it."""
        if os.geteuid() != 0:
            raise TestbedUnavailable("network namespaces need root")
        for tool in ("ip",) + (("tc",) if self.link_gbit else ()):
            if shutil.which(tool) is None:
                raise TestbedUnavailable(f"no {tool!r} on PATH (iproute2)")
        try:
            self._build()
        except BaseException as e:
            self.close()
            if isinstance(e, TestbedError):
                raise TestbedUnavailable(f"cannot build the test bed: {e}") from e
            raise

    def _build(self) -> None:
        sw, t = self.switch, self.timeout
        for ns in [sw, *self.names]:
            _run(["ip", "netns", "add", ns], t)
            self._made.append(ns)
            if shutil.which("sysctl"):  # no IPv6 chatter (router solicitations, MLD) on the links
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                                "net.ipv6.conf.default.disable_ipv6=1"], capture_output=True, timeout=t)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"], t)
        _run(["ip", "-n", sw, "link", "add", "br0", "mtu", str(self.mtu), "type", "bridge"], t)
        for h, (ns, addr) in enumerate(zip(self.names, self.addrs)):
            port = f"p{h}"
            _run(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", IFNAME, "mtu", str(self.mtu), "netns", ns], t)
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"], t)
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME], t)
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"], t)
            if self.link_gbit:
                for where, dev in ((ns, IFNAME), (sw, port)):
                    _run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", *self.tbf_args()], t)
        _run(["ip", "-n", sw, "link", "set", "br0", "mtu", str(self.mtu), "up"], t)

    def tbf_args(self) -> list[str]:
        """The token bucket of a capped link: rate, a burst of 1 ms at the rate (at least 4
        frames and 64 KiB, a GSO packet), and TBF_LATENCY of queue. Bulk transfers then get
        within about 1 % of the rate (measured 0.5 to 10 Gbit/s); a message smaller than the
        burst may still pass at veth speed when the bucket is full, as no real link allows."""
        assert self.link_gbit
        rate_bytes = self.link_gbit * 1e9 / 8
        burst = max(4 * self.mtu, 64 << 10, int(rate_bytes / 1000))
        return ["tbf", "rate", f"{int(self.link_gbit * 1e9)}bit", "burst", str(burst), "latency", TBF_LATENCY]

    def close(self) -> None:
        """Kill what still runs in the namespaces, then delete them (idempotent, never raises)."""
        for ns in self._made:
            try:
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                      timeout=self.timeout).stdout.split()
            except (OSError, subprocess.TimeoutExpired):
                pids = []
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ValueError, OSError):
                    pass
        for ns in reversed(self._made):
            try:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=self.timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._made = []

    def __repr__(self) -> str:
        cap = f", {self.link_gbit:g} gbit" if self.link_gbit else ""
        return f"Hosts({self.count}{cap}, mtu {self.mtu}: {', '.join(self.addrs)})"

    # -- using it ------------------------------------------------------------------------------

    def command(self, h: int, argv: Sequence[str]) -> list[str]:
        """argv, to run inside host h."""
        return ["ip", "netns", "exec", self.names[h], *argv]

    def _counter(self, h: int, name: str) -> int:
        path = f"/sys/class/net/{IFNAME}/statistics/{name}"
        return int(_run(self.command(h, ["cat", path]), self.timeout))

    def tx_bytes(self, h: int) -> int:
        """Bytes host h has sent over its link (layer 2: with Ethernet, IP and TCP headers)."""
        return self._counter(h, "tx_bytes")

    def rx_bytes(self, h: int) -> int:
        """Bytes host h has received over its link (layer 2)."""
        return self._counter(h, "rx_bytes")

    def link_down(self, h: int) -> None:
        """Cut host h off: its rc0 goes down (packets to and from it are lost)."""
        _run(["ip", "-n", self.names[h], "link", "set", IFNAME, "down"], self.timeout)

    def link_up(self, h: int) -> None:
        """Mend host h's link (its address and route come back with it)."""
        _run(["ip", "-n", self.names[h], "link", "set", IFNAME, "up"], self.timeout)

    def throughput_gbit(self, src: int, dst: int, seconds: float = 1.0, port: int = 5201) -> float:
        """Gbit/s of one TCP stream from host src to host dst over `seconds` (an iperf-like
        check of the cap; Python sockets, so on a slow machine the CPU may be the limit)."""
        limit = seconds + 30
        sink = subprocess.Popen(self.command(dst, [sys.executable, "-c", _SINK, self.addrs[dst], str(port)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            assert sink.stdout is not None
            started = select.select([sink.stdout], [], [], limit)[0]
            if not started or sink.stdout.readline().strip() != "ready":
                raise TestbedError(f"throughput sink did not start: {sink.communicate(timeout=limit)[1]}")
            _run(self.command(src, [sys.executable, "-c", _SOURCE, self.addrs[dst], str(port), str(seconds)]),
                 limit)
            out, err = sink.communicate(timeout=limit)
            if sink.returncode != 0:
                raise TestbedError(f"throughput sink failed: {err.strip()}")
            nbytes, elapsed = out.split()
            return int(nbytes) * 8 / float(elapsed) / 1e9
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()


# The two ends of throughput_gbit (only the standard library: starts in a blink). The sink times
# from its first byte to the end of the stream, which includes draining the link's queue.
_SINK = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
server.settimeout(30)
print("ready", flush=True)
conn, _ = server.accept()
conn.settimeout(30)
buf, n, t0 = bytearray(1 << 20), 0, None
while got := conn.recv_into(buf):
    t0 = t0 or time.perf_counter()
    n += got
print(n, time.perf_counter() - t0)
"""
_SOURCE = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
chunk, end = bytes(1 << 20), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    conn.sendall(chunk)
conn.close()
"""
