"""A cluster in a box: real Ray nodes in Linux network namespaces, joined by a bridge through
links shaped with `tc`, for tests and benchmarks whose network must be slower than memory.

    with NetnsCluster(nodes=3, rate="1gbit") as box:      # root, `ip` and `tc` needed
        driver = box.driver()                              # a process in the head's namespace
        result = driver.call("my_package.refits:one_refit", tensors=32)   # JSON in and out
        box.links.partition(2)                             # node 2 cut off from the head

Each node is a `ray start` in its own namespace; node i carries the resource "node<i>" (what
`ray_reshard.on_node` places by). The driver must run inside the head's namespace: `driver()`
starts a Python process there that calls functions by name and returns their JSON results.
Everything the box makes carries the prefix "rrbox-" and lives inside its own namespaces (the
bridge too): no interface or address of the host is touched. `close()` ends every process of
the namespaces and deletes them; a box whose owner died is removed by the next one that starts
(or by `python -m ray_reshard.netns_cluster clean`). See docs/shaped-cluster.md.
"""
from __future__ import annotations

import atexit
import contextlib
import heapq
import importlib
import importlib.util
import json
import os
import random
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["NetnsCluster", "Links", "Driver", "DriverError", "unavailable", "links",
           "node_indices", "rate_bytes_per_s", "clean_leftovers", "leftovers", "PREFIX"]

PREFIX = "rrbox"
SPEC_ENV = "RRBOX_SPEC"          # set in the driver's environment: the box it runs in
NODE_IF = f"{PREFIX}-eth"        # each node's end of its link (GLOO_SOCKET_IFNAME)
BRIDGE = f"{PREFIX}-br"
SUBNET = "10.77.0"               # inside the box's own bridge only: node i is .(10 + i)
HEAD_PORT = 6379
BURST = "256kb"                  # tc token bucket depth per link
STATE_DIR = "/run/rrbox" if os.path.isdir("/run") else os.path.join(tempfile.gettempdir(),
                                                                    "rrbox-state")
_QUANTUM = 60000                 # htb bytes per round: above one 64 KB offload segment's
_DROP_CLASS = "1:99"             # every link's class whose queue holds nothing (partitions)


def unavailable() -> Optional[str]:
    """None where boxes can be made here, else one line saying why not."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (running as uid %d)" % os.geteuid()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    probe = f"{PREFIX}-probe{os.getpid()}"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode:
        return f"`ip netns add` failed: {(r.stderr or r.stdout).strip().splitlines()[-1]}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(cmd, check: bool = True, timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()}")
    return r


# ------------------------------------------------------------------ the box's description
@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    ip: str
    port: str                    # its link's end on the bridge, in the switch namespace


@dataclass(frozen=True)
class Spec:
    """What a box is made of: names and addresses, enough to control it from any process."""

    box_id: str
    switch: str                  # the namespace holding the bridge
    nodes: tuple
    tmp: str                     # the box's own directory (Ray temp dirs, logs, pid files)
    rate: str
    mtu: int

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{HEAD_PORT}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        d = json.loads(text)
        d["nodes"] = tuple(Node(**n) for n in d["nodes"])
        return cls(**d)


def _spec(box_id: str, nodes: int, rate: str, mtu: int) -> Spec:
    base = f"{PREFIX}-{box_id}"
    return Spec(box_id, f"{base}-sw",
                tuple(Node(i, f"{base}-n{i}", f"{SUBNET}.{10 + i}", f"{PREFIX}-p{i}")
                      for i in range(nodes)),
                os.path.join(tempfile.gettempdir(), base), rate, mtu)


# ------------------------------------------------------------------ links
class Links:
    """Every node's link, changed at run time from any process of the machine (as root).

    A link is a veth pair: the node's end (`rrbox-eth`, shaped on its way out of the node) and
    the bridge's end (shaped on its way into the node), so each direction has the rate. Delay,
    jitter and loss are added by a relay process between the bridge and the link (this kernel
    may lack `netem`); partitions drop the packets between two nodes' addresses on both ends.
    """

    def __init__(self, spec: Spec):
        self.spec = spec

    # -- rate
    def set_rate(self, node: int, rate: str) -> None:
        """Shape node `node`'s link to `rate` (tc syntax: "1gbit", "500mbit") both ways."""
        for ns, dev in self._ends(node):
            _run(["tc", "-n", ns, "class", "change", "dev", dev, "parent", "1:", "classid",
                  "1:10", "htb", "rate", rate, "ceil", rate, "burst", BURST, "cburst", BURST,
                  "quantum", str(_QUANTUM)])

    def rate(self, node: int) -> str:
        """Node `node`'s link rate as tc reports it (e.g. "1Gbit")."""
        out = _run(["tc", "-n", self.spec.switch, "class", "show", "dev",
                    self.spec.nodes[node].port, "classid", "1:10"]).stdout
        words = out.split()
        return words[words.index("rate") + 1] if "rate" in words else "?"

    def _ends(self, node: int):
        n = self.spec.nodes[node]
        return [(n.netns, NODE_IF), (self.spec.switch, n.port)]

    # -- delay, jitter, loss
    def impair(self, node: int, delay_ms: float = 0.0, jitter_ms: float = 0.0,
               loss: float = 0.0, seed: int = 0) -> None:
        """Add `delay_ms` (each way, +- up to `jitter_ms`, order kept) and drop a share `loss`
        of the frames each way on node `node`'s link; all zero: back to the plain link.

        A relay process in the switch namespace carries the link's frames (whole offload
        segments, so `loss` drops up to 64 KB at a time) between the bridge and the link."""
        if delay_ms < 0 or jitter_ms < 0 or not 0 <= loss < 1:
            raise ValueError(f"delay_ms and jitter_ms must be >= 0 and loss in [0, 1), got "
                             f"{delay_ms}, {jitter_ms}, {loss}")
        n = self.spec.nodes[node]
        sw = self.spec.switch
        relay_if, bridge_if = f"{PREFIX}-q{node}", f"{PREFIX}-r{node}"
        self._stop_relay(node)
        if not (delay_ms or jitter_ms or loss):
            _run(["ip", "-n", sw, "link", "del", relay_if], check=False)
            _run(["ip", "-n", sw, "link", "set", n.port, "master", BRIDGE])
            return
        if _run(["ip", "-n", sw, "link", "show", relay_if], check=False).returncode:
            _run(["ip", "-n", sw, "link", "add", relay_if, "type", "veth", "peer", "name",
                  bridge_if])
            _run(["ip", "-n", sw, "link", "set", bridge_if, "mtu", str(self.spec.mtu),
                  "master", BRIDGE, "up"])
            _run(["ip", "-n", sw, "link", "set", relay_if, "mtu", str(self.spec.mtu), "up"])
        log = open(os.path.join(self.spec.tmp, f"relay{node}.log"), "wb")
        # run as a script: the relay needs the standard library only (no torch, no Ray)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", sw, sys.executable, os.path.abspath(__file__), "relay", n.port, relay_if, str(delay_ms / 1e3), str(jitter_ms / 1e3), str(loss),
             str(seed)], stdout=log, stderr=log, start_new_session=True)
        log.close()
        with open(self._relay_pidfile(node), "w") as f:
            json.dump({"pid": proc.pid, "delay_ms": delay_ms, "jitter_ms": jitter_ms,
                       "loss": loss}, f)
        # Once the relay holds both sockets, the link leaves the bridge and the relay starts
        # carrying: what arrives meanwhile waits in its sockets, so no frame is lost.
        path = os.path.join(self.spec.tmp, f"relay{node}.log")
        self._await_log(proc, path, "holding", node)
        _run(["ip", "-n", sw, "link", "set", n.port, "nomaster"])
        os.kill(proc.pid, signal.SIGUSR1)
        self._await_log(proc, path, "relaying", node)

    @staticmethod
    def _await_log(proc, path: str, word: str, node: int, within_s: float = 20.0) -> None:
        t_end = time.monotonic() + within_s
        while time.monotonic() < t_end:
            if proc.poll() is not None:
                raise RuntimeError(f"the link relay of node {node} exited: {_tail(path)}")
            if word in _tail(path):
                return
            time.sleep(0.01)
        raise RuntimeError(f"the link relay of node {node} did not say {word!r} within "
                           f"{within_s:.0f} s")

    def _relay_pidfile(self, node: int) -> str:
        return os.path.join(self.spec.tmp, f"relay{node}.json")

    def _stop_relay(self, node: int) -> None:
        path = self._relay_pidfile(node)
        try:
            with open(path) as f:
                pid = json.load(f)["pid"]
        except (OSError, ValueError, KeyError):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        os.unlink(path)

    # -- down, partitions
    def link_down(self, node: int) -> None:
        """Take node `node`'s link down (its bridge end: the node sees no carrier)."""
        _run(["ip", "-n", self.spec.switch, "link", "set", self.spec.nodes[node].port, "down"])

    def link_up(self, node: int) -> None:
        _run(["ip", "-n", self.spec.switch, "link", "set", self.spec.nodes[node].port, "up"])

    def partition(self, node: int, other: int = 0) -> None:
        """Drop every packet between nodes `node` and `other` (default: the head), both ways;
        each keeps reaching the rest."""
        if node == other:
            raise ValueError(f"a node cannot be partitioned from itself ({node})")
        a, b = self.spec.nodes[node], self.spec.nodes[other]
        prio = str(100 + other)
        # out of `node` to `other`, and into `node` from `other` (on the bridge's end)
        for ns, dev, direction, ip in ((a.netns, NODE_IF, "dst", b.ip),
                                       (self.spec.switch, a.port, "src", b.ip)):
            _run(["tc", "-n", ns, "filter", "replace", "dev", dev, "parent", "1:", "protocol",
                  "ip", "prio", prio, "u32", "match", "ip", direction, f"{ip}/32", "flowid",
                  _DROP_CLASS])

    def heal(self, node: int, other: int = 0) -> None:
        """Undo `partition(node, other)`."""
        a = self.spec.nodes[node]
        for ns, dev in ((a.netns, NODE_IF), (self.spec.switch, a.port)):
            _run(["tc", "-n", ns, "filter", "del", "dev", dev, "parent", "1:", "prio",
                  str(100 + other)], check=False)

    def restore(self, node: Optional[int] = None) -> None:
        """Every link (or node `node`'s) back to the box's rate: up, no relay, no partition."""
        for i in ([node] if node is not None else range(len(self.spec.nodes))):
            self.link_up(i)
            self.impair(i)
            for other in range(len(self.spec.nodes)):
                if other != i:
                    self.heal(i, other)
            self.set_rate(i, self.spec.rate)

    # -- what crossed
    def counters(self) -> dict:
        """Bytes and packets through each node's link since it was made, as the kernel counts
        them on the node's end: {node: {"tx_bytes" (out of the node), "rx_bytes" (into it),
        "tx_packets", "rx_packets"}}."""
        out = {}
        for n in self.spec.nodes:
            s = json.loads(_run(["ip", "-n", n.netns, "-j", "-s", "link", "show", "dev",
                                 NODE_IF]).stdout)[0]["stats64"]
            out[n.index] = {"tx_bytes": s["tx"]["bytes"], "rx_bytes": s["rx"]["bytes"],
                            "tx_packets": s["tx"]["packets"], "rx_packets": s["rx"]["packets"]}
        return out

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        """`counters()` after minus before, per node."""
        return {i: {k: after[i][k] - before[i][k] for k in after[i]} for i in after}

    def dropped(self) -> dict:
        """Packets each link's shaping dropped (queues full, partitions), both ends, by node."""
        out = {}
        for n in self.spec.nodes:
            total = 0
            for ns, dev in self._ends(n.index):
                for q in json.loads(_run(["tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev",
                                          dev]).stdout or "[]"):
                    if q.get("root"):
                        total += int(q.get("drops", 0))
            out[n.index] = total
        return out


def links() -> Links:
    """The links of the box this process runs in (in a `driver()`: from its environment)."""
    text = os.environ.get(SPEC_ENV)
    if not text:
        raise RuntimeError(f"not running inside a NetnsCluster driver ({SPEC_ENV} is not set)")
    return Links(Spec.from_json(text))


def node_indices() -> dict:
    """{Ray node id: its index in the box} for the box this driver runs in (Ray connected)."""
    import ray

    by_ip = {n.ip: n.index for n in links().spec.nodes}
    return {n["NodeID"]: by_ip[n["NodeManagerAddress"]] for n in ray.nodes()
            if n.get("Alive") and n["NodeManagerAddress"] in by_ip}


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate ("1gbit", "2gbit", "800mbit", "1.5gbit") in bytes per second."""
    text = rate.strip().lower()
    for suffix, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(suffix):
            try:
                return float(text[:-len(suffix)]) * f / 8
            except ValueError:
                break
    raise ValueError(f"rate {rate!r}: expected a number and gbit, mbit or kbit (e.g. 1gbit)")


# ------------------------------------------------------------------ the box
class NetnsCluster:
    """N Ray nodes (2-4), each in its own network namespace, behind links of `rate` each way.

    `mtu` is every link's (9000: jumbo frames, as datacenter links run; a TCP stream then
    carries 0.99 of the rate, at 1500 about 0.956, since the shaper counts each segment's
    headers). `cpus_per_node` is each node's Ray CPU count, `store_bytes` its object store.
    `start()` (or `with`) builds the network and, unless `with_ray` is False, starts Ray on
    every node; `close()` (also at interpreter exit) ends everything the box made.
    """

    def __init__(self, nodes: int = 2, rate: str = "1gbit", *, mtu: int = 9000,
                 cpus_per_node: int = 1, store_bytes: int = 512 << 20,
                 start_timeout_s: float = 120.0, with_ray: bool = True):
        if not 2 <= nodes <= 4:
            raise ValueError(f"nodes must be 2 to 4, got {nodes}")
        rate_bytes_per_s(rate)
        self.nodes, self.cpus_per_node, self.store_bytes = nodes, cpus_per_node, store_bytes
        self.start_timeout_s, self.with_ray = start_timeout_s, with_ray
        if not 1280 <= mtu <= 65000:
            raise ValueError(f"mtu must be 1280 to 65000, got {mtu}")
        self.spec = _spec(secrets.token_hex(2), nodes, rate, mtu)
        self.links = Links(self.spec)
        self._drivers: list = []
        self._started = False
        self.start_seconds: Optional[float] = None

    @property
    def address(self) -> str:
        """The head's Ray address (reachable only from inside the box's namespaces)."""
        return self.spec.address

    def __enter__(self) -> "NetnsCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "NetnsCluster":
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot build a cluster in a box: {why}")
        t0 = time.perf_counter()
        clean_leftovers()
        self._claim()
        atexit.register(self.close)
        _exit_on_sigterm()
        self._started = True
        try:
            self._network()
            if self.with_ray:
                self._ray()
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - t0
        return self

    def _claim(self) -> None:
        """Record this process as the box's owner, before anything of the box exists (so a
        concurrent `clean_leftovers` never takes a box being built for a dead one's)."""
        os.makedirs(STATE_DIR, exist_ok=True)
        taken = _boxes_present()
        while True:              # an id no other box has, claimed atomically
            if self.spec.box_id not in taken:
                try:
                    fd = os.open(os.path.join(STATE_DIR, self.spec.box_id),
                                 os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    break
                except FileExistsError:
                    pass
            self.spec = _spec(secrets.token_hex(2), self.nodes, self.spec.rate, self.spec.mtu)
            self.links = Links(self.spec)
        with os.fdopen(fd, "w") as f:
            json.dump({"owner": os.getpid(), "owner_start": _start_time(os.getpid())}, f)
        os.makedirs(self.spec.tmp, exist_ok=True)

    def _network(self) -> None:
        s = self.spec
        for ns in [s.switch] + [n.netns for n in s.nodes]:
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", s.switch, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", s.switch, "link", "set", BRIDGE, "up"])
        for n in s.nodes:
            _run(["ip", "-n", s.switch, "link", "add", n.port, "type", "veth", "peer", "name",
                  NODE_IF, "netns", n.netns])
            _run(["ip", "-n", s.switch, "link", "set", n.port, "mtu", str(s.mtu), "master",
                  BRIDGE, "up"])
            _run(["ip", "-n", n.netns, "addr", "add", f"{n.ip}/24", "dev", NODE_IF])
            _run(["ip", "-n", n.netns, "link", "set", NODE_IF, "mtu", str(s.mtu), "up"])
            for ns, dev in self.links._ends(n.index):
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                      "default", "10"])
                _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid",
                      "1:10", "htb", "rate", s.rate, "ceil", s.rate, "burst", BURST, "cburst",
                      BURST, "quantum", str(_QUANTUM)])
                _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid",
                      _DROP_CLASS, "htb", "rate", s.rate, "quantum", str(_QUANTUM)])
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", _DROP_CLASS,
                      "bfifo", "limit", "0"])

    def node_env(self, node: int) -> dict:
        """The environment of node `node`'s Ray processes (and of a driver on the head)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_ADDRESS", "RAY_RESHARD_CLUSTER_ADDRESS"))}
        env.update({"RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": NODE_IF,
                    "RAY_USAGE_STATS_ENABLED": "0", SPEC_ENV: self.spec.to_json()})
        return env

    def _ray(self) -> None:
        """`ray start` on every node: the head, then the others together (each tried up to 3
        times: on a loaded machine a raylet may miss Ray's 30 s start-up wait)."""
        self._start_nodes(self.spec.nodes[:1])
        self._start_nodes(self.spec.nodes[1:])

    def _start_nodes(self, nodes, attempts: int = 3) -> None:
        s = self.spec
        t_end = time.monotonic() + self.start_timeout_s
        procs = {n.index: self._ray_start(n) for n in nodes}
        tries = {n.index: 1 for n in nodes}
        while procs:
            for i, p in list(procs.items()):
                try:
                    p.wait(max(min(t_end - time.monotonic(), 0.2), 0.01))
                except subprocess.TimeoutExpired:
                    if time.monotonic() > t_end:
                        raise RuntimeError(f"`ray start` on node {i} did not finish in "
                                           f"{self.start_timeout_s:.0f} s") from None
                    continue
                del procs[i]
                if p.returncode == 0:
                    continue
                log = _tail(os.path.join(s.tmp, f"ray-start-n{i}.log"))
                if tries[i] >= attempts:
                    raise RuntimeError(f"`ray start` on node {i} failed: {log}")
                for pid in _netns_pids(s.nodes[i].netns):   # what the failed start left
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                tries[i] += 1
                procs[i] = self._ray_start(s.nodes[i])

    def _ray_start(self, n: Node) -> subprocess.Popen:
        s = self.spec
        args = ["ip", "netns", "exec", n.netns, sys.executable, "-c",
                "from ray.scripts.scripts import main; main()", "start",
                "--node-ip-address", n.ip, "--num-cpus", str(self.cpus_per_node),
                "--resources", json.dumps({f"node{n.index}": 100}),
                "--object-store-memory", str(self.store_bytes),
                "--temp-dir", os.path.join(s.tmp, f"n{n.index}"), "--disable-usage-stats"]
        args += (["--head", "--port", str(HEAD_PORT), "--include-dashboard=false"]
                 if n.index == 0 else ["--address", s.address])
        with open(os.path.join(s.tmp, f"ray-start-n{n.index}.log"), "wb") as log:
            return subprocess.Popen(args, stdout=log, stderr=log, env=self.node_env(n.index),
                                    start_new_session=True)

    def popen(self, node: int, argv: list, **kwargs) -> subprocess.Popen:
        """Start `argv` inside node `node`'s namespace (with the node's environment)."""
        if not self._started:
            raise RuntimeError("start() the box first")
        kwargs.setdefault("env", self.node_env(node))
        return subprocess.Popen(["ip", "netns", "exec", self.spec.nodes[node].netns, *argv],
                                **kwargs)

    def driver(self, echo: bool = False) -> "Driver":
        """A Python process on the head node's namespace, connected to the box's Ray cluster
        (every node joined), calling functions by name (see `Driver`). `echo`: its output goes
        to this process's stdout and stderr (else to a log file in the box's directory)."""
        if not self._started or not self.with_ray:
            raise RuntimeError("start() a box with Ray first")
        d = Driver(self, echo)
        self._drivers.append(d)
        return d

    def pids(self) -> list:
        """Every process running in the box's namespaces (Ray's, the driver, link relays)."""
        return [p for ns in [self.spec.switch] + [n.netns for n in self.spec.nodes]
                for p in _netns_pids(ns)]

    def close(self) -> None:
        """End every process in the box's namespaces, delete them and the box's files."""
        if not self._started:
            return
        self._started = False
        for d in self._drivers:
            d.close()
        _remove_box(self.spec.box_id)
        with contextlib.suppress(ValueError):
            atexit.unregister(self.close)


# ------------------------------------------------------------------ cleaning up
def _exit_on_sigterm() -> None:
    """A SIGTERM ends this process through SystemExit (so `with` blocks and atexit take the
    box down), where nothing else handles SIGTERM; a SIGKILL leaves the box to the next start."""
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def stop(signum, frame):
            raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, stop)


def _start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(box_id: str) -> bool:
    try:
        with open(os.path.join(STATE_DIR, box_id)) as f:
            st = json.load(f)
    except (OSError, ValueError):
        return False
    return st.get("owner_start") is not None and _start_time(st["owner"]) == st["owner_start"]


def _boxes_present() -> set:
    r = _run(["ip", "-j", "netns", "list"], check=False)
    names = [d["name"] for d in json.loads(r.stdout or "[]")] if not r.returncode else []
    ids = {n.split("-")[1] for n in names if n.startswith(PREFIX + "-") and n.count("-") >= 2
           and not n.startswith(PREFIX + "-probe")}
    with contextlib.suppress(OSError):
        ids |= set(os.listdir(STATE_DIR))
    tmp = tempfile.gettempdir()
    ids |= {d.split("-", 1)[1] for d in os.listdir(tmp) if d.startswith(PREFIX + "-")
            and d != PREFIX + "-state" and os.path.isdir(os.path.join(tmp, d))}
    return ids


def clean_leftovers() -> list:
    """Remove every box whose owner process is gone (a run killed before its teardown);
    returns their ids. Boxes of live processes are left alone."""
    gone = sorted(b for b in _boxes_present() if not _owner_alive(b))
    for box_id in gone:
        _remove_box(box_id)
    return gone


def _netns_pids(ns: str) -> list:
    r = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in r.stdout.split()] if not r.returncode else []


def _remove_box(box_id: str) -> None:
    """End every process in the box's namespaces (TERM, then KILL after 3 s), then delete the
    namespaces (their links and bridge go with them), its directory and its state file."""
    base = f"{PREFIX}-{box_id}-"
    r = _run(["ip", "-j", "netns", "list"], check=False)
    spaces = [d["name"] for d in json.loads(r.stdout or "[]")
              if d["name"].startswith(base)] if not r.returncode else []
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        pids = [p for ns in spaces for p in _netns_pids(ns) if p != os.getpid()]
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        t_end = time.monotonic() + wait_s
        while pids and time.monotonic() < t_end:
            for p in pids:                   # reap our own children among them
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(p, os.WNOHANG)
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")
                    and _state(p) not in ("Z", "X")]
            time.sleep(0.05)
        if not pids:
            break
    for ns in spaces:
        _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(tempfile.gettempdir(), f"{PREFIX}-{box_id}"), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(STATE_DIR, box_id))


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def leftovers() -> dict:
    """What the box prefix names on this machine now: {"netns": [...], "links": [...] (in the
    root namespace), "dirs": [...], "processes": [pids in those namespaces]} (for checks)."""
    r = _run(["ip", "-j", "netns", "list"], check=False)
    spaces = [d["name"] for d in json.loads(r.stdout or "[]")
              if d["name"].startswith(PREFIX + "-")] if not r.returncode else []
    links_ = [d["ifname"] for d in json.loads(_run(["ip", "-j", "link", "show"]).stdout or "[]")
              if d["ifname"].startswith(PREFIX)]
    tmp = tempfile.gettempdir()
    dirs = [d for d in os.listdir(tmp) if d.startswith(PREFIX + "-") and d != PREFIX + "-state"]
    return {"netns": spaces, "links": links_, "dirs": dirs,
            "processes": [p for ns in spaces for p in _netns_pids(ns)]}


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-4000:]
    except OSError:
        return ""
    return " | ".join(ln.strip() for ln in text.strip().splitlines()[-lines:])


# ------------------------------------------------------------------ the driver
class DriverError(RuntimeError):
    """A function called in the driver raised: its type, message and traceback."""


class Driver:
    """A Python process in the head node's namespace, connected to the box's Ray cluster.

    `call("package.module:function", **kwargs)` (or "path/to/file.py:function") runs the
    function there and returns what it returned (JSON-able); `start(...)` returns a
    `PendingCall` so this process can change the links while it runs. One call at a time.
    """

    def __init__(self, box: NetnsCluster, echo: bool = False):
        spec = box.spec
        req_r, self._req_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        self.log_path = os.path.join(spec.tmp, f"driver-{len(box._drivers)}.log")
        out = None if echo else open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            ["ip", "netns", "exec", spec.head.netns, sys.executable, "-m",
             "ray_reshard.netns_cluster", "serve", str(req_r), str(resp_w), str(box.nodes)],
            pass_fds=(req_r, resp_w), env=box.node_env(0), stdout=out, stderr=out,
            cwd=os.getcwd())
        if out is not None:
            out.close()
        os.close(req_r)
        os.close(resp_w)
        self._buf = b""
        self._ids = 0
        self._busy = False
        hello = self._read(box.start_timeout_s)
        if not hello.get("ok"):
            self.close()
            raise DriverError(f"the driver did not connect: {hello.get('error')}")
        self.nodes = hello["value"]

    @property
    def pid(self) -> int:
        """The driver's process id."""
        return self._proc.pid

    def call(self, target: str, *, call_timeout_s: float = 600.0, **kwargs) -> Any:
        """`target(**kwargs)` in the driver; its return value (DriverError if it raised,
        TimeoutError after `call_timeout_s`)."""
        return self.start(target, **kwargs).result(call_timeout_s)

    def start(self, target: str, **kwargs) -> "PendingCall":
        if self._busy:
            raise RuntimeError("the driver is running another call")
        self._ids += 1
        msg = json.dumps({"id": self._ids, "target": target, "kwargs": kwargs}) + "\n"
        os.write(self._req_w, msg.encode())
        self._busy = True
        return PendingCall(self, target)

    def _read(self, timeout_s: float) -> dict:
        t_end = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = t_end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the driver did not answer within {timeout_s:.0f} s "
                                   f"(log: {self.log_path})")
            ready, _, _ = select.select([self._resp_r], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._resp_r, 1 << 20)
                if not chunk:
                    raise DriverError(f"the driver exited ({self._proc.poll()}): "
                                      f"{_tail(self.log_path)}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                os.close(self._req_w)            # the driver ends its loop on EOF
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for fd in (self._req_w, self._resp_r):
            with contextlib.suppress(OSError):
                os.close(fd)


class PendingCall:
    def __init__(self, driver: Driver, target: str):
        self.driver, self.target = driver, target

    def result(self, timeout_s: float = 600.0) -> Any:
        try:
            reply = self.driver._read(timeout_s)
        finally:
            self.driver._busy = False
        if reply.get("ok"):
            return reply["value"]
        raise DriverError(f"{self.target}: {reply.get('error')}\n{reply.get('traceback', '')}")


def _resolve(target: str):
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ValueError(f"target {target!r}: expected 'package.module:function' or "
                         f"'path/file.py:function'")
    if where.endswith(".py"):
        mod_name = "rrbox_" + os.path.splitext(os.path.basename(where))[0]
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, os.path.abspath(where))
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
            import ray.cloudpickle
            ray.cloudpickle.register_pickle_by_value(module)   # workers cannot import it
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _serve(fd_in: int, fd_out: int, nodes: int) -> int:
    """The driver's loop (runs inside the head's namespace)."""
    import logging

    import ray

    out = os.fdopen(fd_out, "w", buffering=1)

    def reply(d):
        out.write(json.dumps(d) + "\n")
        out.flush()

    spec = Spec.from_json(os.environ[SPEC_ENV])
    try:
        ray.init(address=spec.address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        t_end = time.monotonic() + 120
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if len(alive) >= nodes:
                break
            if time.monotonic() > t_end:
                raise RuntimeError(f"{len(alive)} of {nodes} nodes joined within 120 s")
            time.sleep(0.2)
        reply({"ok": True, "value": sorted(n["NodeManagerAddress"] for n in alive)})
    except Exception as e:
        reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    for line in os.fdopen(fd_in):
        req = json.loads(line)
        try:
            value = _resolve(req["target"])(**req["kwargs"])
            reply({"id": req["id"], "ok": True, "value": value})
        except BaseException as e:
            reply({"id": req["id"], "ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()})
    ray.shutdown()
    return 0


# ------------------------------------------------------------------ the link relay
def _relay(a: str, b: str, delay_s: float, jitter_s: float, loss: float, seed: int) -> int:
    """Carry frames between interfaces `a` and `b` (raw sockets, offload headers kept), each
    held `delay_s` +- `jitter_s` (order kept per direction), a share `loss` dropped."""
    ETH_P_ALL, SOL_PACKET, PACKET_VNET_HDR, OUTGOING = 3, 263, 15, 4

    def sock(ifname):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        # root may exceed net.core.rmem_max: a delayed link holds a whole window in flight
        s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)           # SO_RCVBUFFORCE
        s.setsockopt(socket.SOL_SOCKET, 32, 64 << 20)           # SO_SNDBUFFORCE
        s.bind((ifname, 0))
        s.setblocking(False)
        return s

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    sa, sb = sock(a), sock(b)
    print(f"holding {a} and {b}", flush=True)
    signal.sigwait({signal.SIGUSR1})           # the link has left the bridge: carry it
    other = {sa: sb, sb: sa}
    last = {sa: 0.0, sb: 0.0}
    rng = random.Random(seed)
    queue: list = []
    seq = 0
    print(f"relaying {a} <-> {b}: delay {delay_s * 1e3:g} ms, jitter {jitter_s * 1e3:g} ms, "
          f"loss {loss:g}", flush=True)
    carried = failed = lost = 0
    report = time.monotonic() + 5.0
    while True:
        if time.monotonic() >= report:      # what it did, for whoever reads its log
            print(f"carried {carried} frames, lost {lost} on purpose, {failed} failed to send, "
                  f"{len(queue)} held", flush=True)
            report = time.monotonic() + 5.0
        wait = max(min(queue[0][0], report) - time.monotonic(), 0.0) if queue else 1.0
        ready, _, _ = select.select([sa, sb], [], [], wait)
        for s in ready:
            while True:
                try:
                    data, addr = s.recvfrom(1 << 17)
                except BlockingIOError:
                    break
                if addr[2] == OUTGOING:
                    continue
                if loss and rng.random() < loss:
                    lost += 1
                    continue
                at = time.monotonic() + delay_s + (rng.uniform(-jitter_s, jitter_s)
                                                   if jitter_s else 0.0)
                at = max(at, last[s])          # jitter never reorders a direction
                last[s] = at
                seq += 1
                heapq.heappush(queue, (at, seq, other[s], data))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, s, data = heapq.heappop(queue)
            try:
                s.send(data)
                carried += 1
            except OSError as e:
                failed += 1
                if failed <= 3:
                    print(f"send of {len(data)} bytes failed: {e}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else ""
    if cmd == "serve":
        return _serve(int(argv[1]), int(argv[2]), int(argv[3]))
    if cmd == "relay":
        return _relay(argv[1], argv[2], float(argv[3]), float(argv[4]), float(argv[5]),
                      int(argv[6]))
    if cmd == "clean":
        why = unavailable()
        if why:
            print(f"nothing to clean: {why}")
            return 0
        gone = clean_leftovers()
        print(f"removed {len(gone)} box(es) left by dead runs" +
              (f": {', '.join(gone)}" if gone else ""))
        return 0
    if cmd == "check":
        why = unavailable()
        print(why or "network namespaces, bridges and tc work here")
        return 1 if why else 0
    print("usage: python -m ray_reshard.netns_cluster clean | check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
