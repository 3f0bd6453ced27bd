"""Pod networks for the node agent: a network namespace per pod, as a kubelet with a CNI plugin makes, or
loopback addresses where namespaces cannot be made.

Namespace mode (root and `ip` available; what CI uses):

- each run takes a /24 of 198.18.0.0/15 (the range reserved for benchmarks, routed nowhere): .1 is the
  node's side, .2-.254 its pods;
- a pod gets a network namespace `kvpe2e-<tag>-<n>` and a veth pair: `kve<tag><n>` on the host (with the
  node's address, forwarding on, and a host route to the pod) and `eth0` inside with the pod's /32;
- inside, routes to the node address and to 198.18.0.0/15 through it, no default route: a pod reaches
  the host and the other pods (the router reaches the daemons) and nothing else;
- a pod that calls the API (the router) gets the API server's address inside its namespace as well: a
  socket the agent listens on in that namespace, piped to the real server, which is what kube-proxy does
  for the `kubernetes` Service (`bridge_api`);
- `<tag>` is the run's process id and a sequence number in hex, so `sweep` can tell a dead run's
  leftovers (namespaces, links, /etc/netns folders) from a live one's and remove them; every run sweeps
  at its start and removes its own at the end, and an atexit hook sweeps the process's own.

Loopback mode: each pod on its own 127.0.0.x of the host, as before. The mode is chosen once per
process (`E2E_POD_NETWORK=netns|loopback` forces one) and reported once.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

log = logging.getLogger("e2e.netns")

POD_RANGE = ipaddress.ip_network("198.18.0.0/15")
NS_PREFIX = "kvpe2e-"
LINK_PREFIX = "kve"
ENV_MODE = "E2E_POD_NETWORK"
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
_NS_RE = re.compile(rf"^{NS_PREFIX}([0-9a-f]{{6}})([0-9a-f])-(\d+)$")
_LINK_RE = re.compile(rf"^{LINK_PREFIX}([0-9a-f]{{6}})([0-9a-f])(\d+)$")
CLONE_NEWNET = 0x40000000
_seq = itertools.count()


class NetnsError(RuntimeError):
    pass


@dataclass
class Attachment:
    """One pod's network: its address and, in namespace mode, its namespace and host-side link."""

    ip: str
    netns: str | None = None
    link: str | None = None
    index: int = 0

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The command line that runs argv in the pod's network (as a container runtime would)."""
        return [_ip(), "netns", "exec", self.netns, *argv] if self.netns else list(argv)


class PodNetwork(Protocol):
    mode: str

    def attach(self, pod: str, port: int) -> Attachment: ...

    def detach(self, att: Attachment) -> None: ...

    async def bridge_api(self, att: Attachment, url: str) -> None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------------ helpers

def _ip() -> str:
    return shutil.which("ip") or "/sbin/ip"


def _run(*args: str, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run([_ip(), *args], input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_tag(pid: int | None = None, seq: int | None = None) -> str:
    """7 hex digits: the process id (6) and a sequence number (1), so names fit IFNAMSIZ (15)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid & 0xFFFFFF:06x}{(next(_seq) if seq is None else seq) % 16:x}"


def netns_names() -> list[str]:
    return [line.split()[0] for line in _run("netns", "list", check=False).splitlines() if line.strip()]


def link_names() -> list[str]:
    out = []
    for line in _run("-o", "link", "show", check=False).splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@")[0])
    return out


def leftovers(tag_prefix: str = "") -> dict[str, list[str]]:
    """The e2e's namespaces, links and routes on this machine (of one tag, or of all runs)."""
    ns = [n for n in netns_names() if n.startswith(NS_PREFIX + tag_prefix)]
    links = [n for n in link_names() if n.startswith(LINK_PREFIX + tag_prefix) and _LINK_RE.match(n)]
    routes = [r for r in _run("-4", "route", "show", check=False).splitlines()
              if any(f"dev {link}" in r for link in links) or (not tag_prefix and f" dev {LINK_PREFIX}" in r)]
    return {"netns": ns, "links": links, "routes": routes}


def _kill_inside(name: str) -> None:
    for pid in _run("netns", "pids", name, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove(netns: str | None, link: str | None) -> None:
    """Delete a pod's link (both ends go), its namespace and its /etc/netns folder; each step on its own."""
    if netns:
        _kill_inside(netns)
    if link:
        _run("link", "del", link, check=False)
    if netns:
        _run("netns", "del", netns, check=False)
        shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)


def sweep(pid: int | None = None) -> list[str]:
    """Remove the leftovers of dead runs (or of every run of `pid`): what a killed run could not remove."""
    removed = []

    def stale(m: re.Match[str] | None) -> bool:
        if m is None:
            return False
        owner = int(m.group(1), 16)
        return owner == pid if pid is not None else not _alive(owner)
    for name in netns_names():
        if stale(_NS_RE.match(name)):
            _remove(name, None)
            removed.append(name)
    for name in link_names():
        if stale(_LINK_RE.match(name)):
            _run("link", "del", name, check=False)
            removed.append(name)
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.iterdir():
            if stale(_NS_RE.match(d.name)):
                shutil.rmtree(d, ignore_errors=True)
    return removed


def socket_in(netns: str, ip: str, port: int) -> socket.socket:
    """A listening TCP socket inside a network namespace, made by a thread that enters it (setns acts on
    the calling thread only); the socket stays in that namespace while the agent's loop serves it."""
    result: dict[str, object] = {}

    def inside() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(NETNS_DIR / netns, os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns}")
            try:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((ip, port))
                s.listen(64)
                s.setblocking(False)
                result["sock"] = s
            finally:
                libc.setns(own, CLONE_NEWNET)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = e
        finally:
            os.close(own)
            os.close(target)
    t = threading.Thread(target=inside, name=f"setns-{netns}")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["sock"]  # type: ignore[return-value]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


# ------------------------------------------------------------------------------------------------ modes

class LoopbackNetwork:
    """Each pod on its own 127.0.0.x of the host (.2 up): the fallback without namespaces."""

    mode = "loopback"

    def __init__(self) -> None:
        self._next = 2
        self._used: set[str] = set()

    def attach(self, pod: str, port: int) -> Attachment:  # noqa: ARG002 - PodNetwork's signature
        for _ in range(250):
            n = self._next
            self._next = 2 if self._next >= 254 else self._next + 1
            ip = f"127.0.0.{n}"
            if ip not in self._used and _port_free(ip, port):
                self._used.add(ip)
                return Attachment(ip=ip, index=n)
        raise RuntimeError(f"no free loopback address with port {port} free")

    def detach(self, att: Attachment) -> None:
        self._used.discard(att.ip)

    async def bridge_api(self, att: Attachment, url: str) -> None:  # noqa: ARG002 - PodNetwork's signature
        return None  # the pod shares the host's network: the API server's address works as it is

    def close(self) -> None:
        self._used.clear()


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


@dataclass
class NamespaceNetwork:
    """A namespace and a veth pair per pod, addresses from the run's /24 of 198.18.0.0/15 (module doc)."""

    tag: str = field(default_factory=run_tag)
    mode: str = "netns"
    subnet: ipaddress.IPv4Network = field(init=False)
    gateway: str = field(init=False)
    pods: dict[int, Attachment] = field(default_factory=dict, init=False)
    _servers: dict[str, list[asyncio.AbstractServer]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        sweep()  # what killed runs left behind
        self.subnet = self._pick_subnet()
        self.gateway = str(self.subnet.network_address + 1)
        _OPEN.append(self)

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        """The first /24 from a pid-dependent start that no address or route on this machine touches, so
        that concurrent runs on one machine take different ones."""
        taken = set()
        for line in _run("-4", "-o", "addr", "show", check=False).splitlines() + \
                _run("-4", "route", "show", check=False).splitlines():
            for word in line.replace("/", " ").split():
                with contextlib.suppress(ValueError):
                    addr = ipaddress.ip_address(word)
                    if addr in POD_RANGE:
                        taken.add(int(addr) >> 8)
        subnets = list(POD_RANGE.subnets(new_prefix=24))
        start = int(self.tag, 16) % len(subnets)
        for i in range(len(subnets)):
            s = subnets[(start + i) % len(subnets)]
            if int(s.network_address) >> 8 not in taken:
                return s
        raise NetnsError("no free /24 in 198.18.0.0/15")

    def names(self, n: int) -> tuple[str, str]:
        return f"{NS_PREFIX}{self.tag}-{n}", f"{LINK_PREFIX}{self.tag}{n}"

    def attach(self, pod: str, port: int) -> Attachment:  # noqa: ARG002 - a namespace has every port free
        n = next((i for i in range(2, 255) if i not in self.pods), None)
        if n is None:
            raise NetnsError(f"no free address in {self.subnet}")
        netns, link = self.names(n)
        ip = str(self.subnet.network_address + n)
        att = Attachment(ip=ip, netns=netns, link=link, index=n)
        self.pods[n] = att
        try:
            _run("netns", "add", netns)
            _run("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
            (Path("/proc/sys/net/ipv4/conf") / link / "forwarding").write_text("1")  # pod to pod, this link only
            _run("-batch", "-", stdin="\n".join([
                f"link set {link} up",
                f"addr add {self.gateway}/32 dev {link}",
                f"route add {ip}/32 dev {link} scope link src {self.gateway}",
            ]) + "\n")
            _run("-n", netns, "-batch", "-", stdin="\n".join([
                "link set lo up",
                f"addr add {ip}/32 dev eth0",
                "link set eth0 up",
                f"route add {self.gateway}/32 dev eth0 scope link",
                f"route add {POD_RANGE} via {self.gateway} dev eth0",  # the pods, through the node; no default
            ]) + "\n")
            # The kubelet-managed /etc/hosts: the pod's host name is its own address. A process that finds its
            # address by its host name (gloo, for the ranks of a multi-node group) gets the pod IP, not 127.0.0.1.
            folder = ETC_NETNS / netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{ip} {socket.gethostname()}\n")
        except Exception:
            self.detach(att)
            raise
        log.info("pod %s: netns %s, %s on %s", pod, netns, ip, link)
        return att

    def detach(self, att: Attachment) -> None:
        for server in self._servers.pop(att.netns or "", []):
            server.close()
        _remove(att.netns, att.link)
        self.pods.pop(att.index, None)

    async def bridge_api(self, att: Attachment, url: str) -> None:
        """Make the API server's URL work inside the pod: a listener at the same address and port in the
        pod's namespace (the address added to its lo when it is not loopback; a host name resolved here and
        written to /etc/netns/<ns>/hosts, which `ip netns exec` mounts), piped to the server."""
        assert att.netns is not None
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=socket.AF_INET,
                                                             type=socket.SOCK_STREAM)
        addr = infos[0][4][0]
        if not ipaddress.ip_address(addr).is_loopback:
            _run("-n", att.netns, "addr", "add", f"{addr}/32", "dev", "lo")
        if host != addr:
            folder = ETC_NETNS / att.netns
            folder.mkdir(parents=True, exist_ok=True)
            hosts = folder / "hosts"
            kept = hosts.read_text() if hosts.exists() else "127.0.0.1 localhost\n"
            hosts.write_text(f"{kept}{addr} {host}\n")
        sock = socket_in(att.netns, addr, port)

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_r, up_w = await asyncio.open_connection(addr, port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        server = await asyncio.start_server(relay, sock=sock)
        self._servers.setdefault(att.netns, []).append(server)

    def close(self) -> None:
        for att in list(self.pods.values()):
            self.detach(att)
        sweep_tag(self.tag)
        with contextlib.suppress(ValueError):
            _OPEN.remove(self)


def sweep_tag(tag: str) -> None:
    for name in netns_names():
        if name.startswith(f"{NS_PREFIX}{tag}-"):
            _remove(name, None)
    for name in link_names():
        m = _LINK_RE.match(name)
        if m and m.group(1) + m.group(2) == tag:
            _run("link", "del", name, check=False)


_OPEN: list[NamespaceNetwork] = []


@atexit.register
def _at_exit() -> None:
    """A run that never reached its teardown (an interrupt): its namespaces go with the process."""
    for net in _OPEN.copy():
        with contextlib.suppress(Exception):
            net.close()
    if _CHOSEN and _CHOSEN[0] == "netns":
        with contextlib.suppress(Exception):
            sweep(os.getpid())


# ------------------------------------------------------------------------------------------------ choice

_CHOSEN: list[str] = []  # [mode, why], set once per process


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can), found by making one and removing it."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    if not NETNS_DIR.parent.is_dir():
        return "no /run"
    probe = None
    try:
        probe = NamespaceNetwork()
        probe.attach("probe", 0)
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        return f"making a network namespace failed: {e}"
    finally:
        if probe is not None:
            probe.close()
    return None


def choose() -> tuple[str, str]:
    """("netns" or "loopback", why): namespaces where they can be made, else loopback; reported once."""
    if not _CHOSEN:
        forced = os.environ.get(ENV_MODE, "").strip().lower()
        if forced == "loopback":
            mode, why = "loopback", f"{ENV_MODE}=loopback"
        else:
            reason = unavailable()
            if reason is None:
                mode, why = "netns", "a network namespace per pod, addresses from 198.18.0.0/15"
            elif forced == "netns":
                raise NetnsError(f"{ENV_MODE}=netns, but {reason}")
            else:
                mode, why = "loopback", f"pods on 127.0.0.x: {reason}"
        _CHOSEN[:] = [mode, why]
        log.warning("e2e pod network: %s (%s)", mode, why)
        print(f"\ne2e pod network: {mode} ({why})", file=sys.stderr)
    return _CHOSEN[0], _CHOSEN[1]


def open_network() -> PodNetwork:
    """The chosen mode's network for one run; the caller closes it."""
    return NamespaceNetwork() if choose()[0] == "netns" else LoopbackNetwork()


def is_pod_address(ip: str, mode: str) -> bool:
    """Whether ip is a pod's address in that mode: 198.18.0.0/15 (netns), or 127.0.0.x other than .1."""
    addr = ipaddress.ip_address(ip)
    if mode == "netns":
        return addr in POD_RANGE
    return addr.is_loopback and ip != "127.0.0.1"


def chosen() -> tuple[str, str] | None:
    """The mode this process chose, if it chose one yet."""
    return (_CHOSEN[0], _CHOSEN[1]) if _CHOSEN else None
