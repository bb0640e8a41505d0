"""A test bed of several "hosts" on one Linux machine, for tests and the benchmark.

Each host is a network namespace whose only link, ``rc0``, is one end of a veth pair; the other
end is a port of a Linux bridge in a "switch" namespace of its own. So ranks in different hosts
see different IP addresses and reach each other only through that link, as on real machines,
and ranks in the same host share its network namespace (and so, for rustc10d, shared memory).
With ``link_gbit`` every link is capped in both directions by a token bucket (``tc qdisc ...
tbf``): host side ``rc0`` egress is what the host sends, the switch port's egress what it
receives. With ``flow_gbit`` each TCP connection is capped on its own as well, the way one
stream fails to fill a fast link on real machines (``htb``, with a class per hash of the
connection's port; see ``flow_cap_batch``). Needs root and iproute2 (``ip``; ``tc`` for a
cap)::

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
import tempfile
from collections.abc import Sequence
from types import TracebackType

__all__ = ["Hosts", "TestbedError", "TestbedUnavailable"]

IFNAME = "rc0"  # each host's link, the same name in every host
SUBNET = "10.213.{}.{}"  # private addresses that exist only inside the test bed's namespaces
TBF_LATENCY = "50ms"  # how long a packet may wait in a capped link's queue before it is dropped


class TestbedError(RuntimeError):
    """A command on the test bed failed (its argv and stderr are in the message)."""


class TestbedUnavailable(TestbedError):
    """The test bed cannot be built here: not root, or no iproute2. Tests skip on it. Anything
    else that fails while building it (the kernel refused a namespace, a veth, a bridge or a
    qdisc) is a TestbedError, which fails the test: a broken test bed must not turn the
    multi-host tests off silently."""


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

    def __init__(self, count: int, link_gbit: float | None = None, mtu: int = 9000, timeout: float = 10.0,
                 flow_gbit: float | None = None):
        if not 1 <= count <= 250:
            raise ValueError(f"count must be 1 to 250, not {count}")
        for name, rate in (("link_gbit", link_gbit), ("flow_gbit", flow_gbit)):
            if rate is not None and not rate > 0:
                raise ValueError(f"{name} must be positive, not {rate}")
        if not 1280 <= mtu <= 65535:
            raise ValueError(f"mtu must be 1280 to 65535, not {mtu}")
        self.count, self.link_gbit, self.mtu, self.timeout = count, link_gbit, mtu, timeout
        self.flow_gbit = flow_gbit
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
        """Build the test bed; raises TestbedUnavailable if the machine cannot (not root, no
        iproute2), TestbedError (after undoing what was built) if building it failed."""
        if os.geteuid() != 0:
            raise TestbedUnavailable("network namespaces need root")
        for tool in ("ip",) + (("tc",) if self.link_gbit or self.flow_gbit else ()):
            if shutil.which(tool) is None:
                raise TestbedUnavailable(f"no {tool!r} on PATH (iproute2)")
        try:
            self._build()
        except BaseException:
            self.close()
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
            for where, dev in ((ns, IFNAME), (sw, port)):
                if self.flow_gbit:
                    with tempfile.NamedTemporaryFile("w", suffix=".tc") as batch:
                        batch.write("\n".join(self.flow_cap_batch(dev)) + "\n")
                        batch.flush()
                        _run(["tc", "-n", where, "-batch", batch.name], t)
                elif self.link_gbit:
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

    def flow_cap_batch(self, dev: str) -> list[str]:
        """``tc -batch`` lines that cap each TCP connection leaving ``dev`` at flow_gbit, and
        all of them together at link_gbit (uncapped: 100 Gbit/s). An htb class per bucket,
        256 buckets, each capped; u32 filters put a connection in the bucket of bits 1 to 8 of
        its port on this machine's side of the connect: the source port where it is even (Linux
        gives connect() even ports), else the destination port (the packet leaves a listening
        socket, whose port bind() made odd). So the connections of one process to one peer,
        dialled one after another, land in different buckets; two may share one by chance."""
        assert self.flow_gbit
        link = int((self.link_gbit or 100) * 1e9)
        flow = int(self.flow_gbit * 1e9)
        burst = max(4 * self.mtu, 64 << 10, link // 8 // 1000)
        # quantum: bytes a class sends per turn; at least a frame, small enough to share fairly.
        q = f"quantum {max(self.mtu, 16 << 10)}"
        # A class's rate is assured to it whatever its parent's: the buckets' share of the link
        # is; each borrows up to its ceil, the cap of a connection, while the link has room.
        share = min(flow, link // 257)
        lines = [f"qdisc add dev {dev} root handle 1: htb default 2",
                 f"class add dev {dev} parent 1: classid 1:1 htb rate {link}bit ceil {link}bit burst {burst} {q}"]
        lines += [f"class add dev {dev} parent 1:1 classid 1:{c:x} htb rate {share}bit ceil {flow}bit {q}"
                  for c in [2, *range(0x100, 0x200)]]
        for table, mask, parity in ((2, "0x01fe0000", 0), (3, "0x000001fe", 1)):
            lines.append(f"filter add dev {dev} parent 1: prio 1 handle {table}: protocol ip u32 divisor 256")
            lines += [f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht {table}:{b:x}: match u32 0 0 "
                      f"flowid 1:{0x100 + b:x}" for b in range(256)]
            # The ports' word is at byte 20 of an IPv4 packet without options (TCP's are off here).
            lines.append(f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 800:: match ip protocol 6 0xff "
                         f"match ip sport {parity} 0x0001 hashkey mask {mask} at 20 link {table}:")
        return lines

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
        cap += f", {self.flow_gbit:g} gbit per connection" if self.flow_gbit else ""
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

    def throughput_gbit(self, src: int, dst: int, seconds: float = 1.0, port: int = 5201, streams: int = 1) -> float:
        """Gbit/s of `streams` TCP streams together from host src to host dst over `seconds` (an
        iperf-like check of the caps; Python sockets, so on a slow machine the CPU may be the
        limit). Stream k uses port + k."""
        limit = seconds + 30
        sinks = [subprocess.Popen(self.command(dst, [sys.executable, "-c", _SINK, self.addrs[dst], str(port + k)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
                 for k in range(streams)]
        sources: list[subprocess.Popen] = []
        try:
            for sink in sinks:
                assert sink.stdout is not None
                started = select.select([sink.stdout], [], [], limit)[0]
                if not started or sink.stdout.readline().strip() != "ready":
                    raise TestbedError(f"throughput sink did not start: {sink.communicate(timeout=limit)[1]}")
            sources = [subprocess.Popen(self.command(src, [sys.executable, "-c", _SOURCE, self.addrs[dst],
                                                           str(port + k), str(seconds)]),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        text=True) for k in range(streams)]
            total = 0.0
            for source, sink in zip(sources, sinks):
                if source.wait(timeout=limit) != 0:
                    raise TestbedError(f"throughput source failed: {source.communicate()[1].strip()}")
                out, err = sink.communicate(timeout=limit)
                if sink.returncode != 0:
                    raise TestbedError(f"throughput sink failed: {err.strip()}")
                nbytes, elapsed = out.split()
                total += int(nbytes) * 8 / float(elapsed) / 1e9
            return total
        finally:
            for p in sources + sinks:
                if p.poll() is None:
                    p.kill()
                    p.wait()


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
