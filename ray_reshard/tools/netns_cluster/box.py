"""The box: N Ray nodes in network namespaces behind a bridge, started, watched and removed (also
the boxes of runs that died)."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from .driver import Driver
from .links import Links
from .spec import (BRIDGE, BURST, DROP_CLASS, HEAD_PORT, NODE_IF, PREFIX, QUANTUM, SPEC_ENV,
                   STATE_DIR, Node, log_tail, make_spec, rate_bytes_per_s, run_cmd, unavailable)

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
        self.spec = make_spec(secrets.token_hex(2), nodes, rate, mtu)
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
            self.spec = make_spec(secrets.token_hex(2), self.nodes, self.spec.rate, self.spec.mtu)
            self.links = Links(self.spec)
        with os.fdopen(fd, "w") as f:
            json.dump({"owner": os.getpid(), "owner_start": _start_time(os.getpid())}, f)
        os.makedirs(self.spec.tmp, exist_ok=True)

    def _network(self) -> None:
        s = self.spec
        for ns in [s.switch] + [n.netns for n in s.nodes]:
            run_cmd(["ip", "netns", "add", ns])
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        run_cmd(["ip", "-n", s.switch, "link", "add", BRIDGE, "type", "bridge"])
        run_cmd(["ip", "-n", s.switch, "link", "set", BRIDGE, "up"])
        for n in s.nodes:
            run_cmd(["ip", "-n", s.switch, "link", "add", n.port, "type", "veth", "peer", "name",
                  NODE_IF, "netns", n.netns])
            run_cmd(["ip", "-n", s.switch, "link", "set", n.port, "mtu", str(s.mtu), "master",
                  BRIDGE, "up"])
            run_cmd(["ip", "-n", n.netns, "addr", "add", f"{n.ip}/24", "dev", NODE_IF])
            run_cmd(["ip", "-n", n.netns, "link", "set", NODE_IF, "mtu", str(s.mtu), "up"])
            for ns, dev in self.links._ends(n.index):
                run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                      "default", "10"])
                run_cmd(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid",
                      "1:10", "htb", "rate", s.rate, "ceil", s.rate, "burst", BURST, "cburst",
                      BURST, "quantum", str(QUANTUM)])
                run_cmd(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid",
                      DROP_CLASS, "htb", "rate", s.rate, "quantum", str(QUANTUM)])
                run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", DROP_CLASS,
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
                log = log_tail(os.path.join(s.tmp, f"ray-start-n{i}.log"))
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
        d = Driver(self, echo, index=len(self._drivers))
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
    r = run_cmd(["ip", "-j", "netns", "list"], check=False)
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
    r = run_cmd(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in r.stdout.split()] if not r.returncode else []


def _remove_box(box_id: str) -> None:
    """End every process in the box's namespaces (TERM, then KILL after 3 s), then delete the
    namespaces (their links and bridge go with them), its directory and its state file."""
    base = f"{PREFIX}-{box_id}-"
    r = run_cmd(["ip", "-j", "netns", "list"], check=False)
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
        run_cmd(["ip", "netns", "del", ns], check=False)
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
    r = run_cmd(["ip", "-j", "netns", "list"], check=False)
    spaces = [d["name"] for d in json.loads(r.stdout or "[]")
              if d["name"].startswith(PREFIX + "-")] if not r.returncode else []
    links_ = [d["ifname"] for d in json.loads(run_cmd(["ip", "-j", "link", "show"]).stdout or "[]")
              if d["ifname"].startswith(PREFIX)]
    tmp = tempfile.gettempdir()
    dirs = [d for d in os.listdir(tmp) if d.startswith(PREFIX + "-") and d != PREFIX + "-state"]
    return {"netns": spaces, "links": links_, "dirs": dirs,
            "processes": [p for ns in spaces for p in _netns_pids(ns)]}

