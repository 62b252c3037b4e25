"""Every node's link, changed at run time (rate, delay, loss, down, partition) and counted by the
kernel."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from .spec import (BRIDGE, BURST, DROP_CLASS, NODE_IF, PREFIX, QUANTUM, SPEC_ENV, Spec, log_tail,
                   run_cmd)

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
            run_cmd(["tc", "-n", ns, "class", "change", "dev", dev, "parent", "1:", "classid",
                  "1:10", "htb", "rate", rate, "ceil", rate, "burst", BURST, "cburst", BURST,
                  "quantum", str(QUANTUM)])

    def rate(self, node: int) -> str:
        """Node `node`'s link rate as tc reports it (e.g. "1Gbit")."""
        out = run_cmd(["tc", "-n", self.spec.switch, "class", "show", "dev",
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
            run_cmd(["ip", "-n", sw, "link", "del", relay_if], check=False)
            run_cmd(["ip", "-n", sw, "link", "set", n.port, "master", BRIDGE])
            return
        if run_cmd(["ip", "-n", sw, "link", "show", relay_if], check=False).returncode:
            run_cmd(["ip", "-n", sw, "link", "add", relay_if, "type", "veth", "peer", "name",
                  bridge_if])
            run_cmd(["ip", "-n", sw, "link", "set", bridge_if, "mtu", str(self.spec.mtu),
                  "master", BRIDGE, "up"])
            run_cmd(["ip", "-n", sw, "link", "set", relay_if, "mtu", str(self.spec.mtu), "up"])
        log = open(os.path.join(self.spec.tmp, f"relay{node}.log"), "wb")
        # run as a script: the relay needs the standard library only (no torch, no Ray)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", sw, sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py"), n.port, relay_if, str(delay_ms / 1e3), str(jitter_ms / 1e3), str(loss),
             str(seed)], stdout=log, stderr=log, start_new_session=True)
        log.close()
        with open(self._relay_pidfile(node), "w") as f:
            json.dump({"pid": proc.pid, "delay_ms": delay_ms, "jitter_ms": jitter_ms,
                       "loss": loss}, f)
        # Once the relay holds both sockets, the link leaves the bridge and the relay starts
        # carrying: what arrives meanwhile waits in its sockets, so no frame is lost.
        path = os.path.join(self.spec.tmp, f"relay{node}.log")
        self._await_log(proc, path, "holding", node)
        run_cmd(["ip", "-n", sw, "link", "set", n.port, "nomaster"])
        os.kill(proc.pid, signal.SIGUSR1)
        self._await_log(proc, path, "relaying", node)

    @staticmethod
    def _await_log(proc, path: str, word: str, node: int, within_s: float = 20.0) -> None:
        t_end = time.monotonic() + within_s
        while time.monotonic() < t_end:
            if proc.poll() is not None:
                raise RuntimeError(f"the link relay of node {node} exited: {log_tail(path)}")
            if word in log_tail(path):
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
        run_cmd(["ip", "-n", self.spec.switch, "link", "set", self.spec.nodes[node].port, "down"])

    def link_up(self, node: int) -> None:
        run_cmd(["ip", "-n", self.spec.switch, "link", "set", self.spec.nodes[node].port, "up"])

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
            run_cmd(["tc", "-n", ns, "filter", "replace", "dev", dev, "parent", "1:", "protocol",
                  "ip", "prio", prio, "u32", "match", "ip", direction, f"{ip}/32", "flowid",
                  DROP_CLASS])

    def heal(self, node: int, other: int = 0) -> None:
        """Undo `partition(node, other)`."""
        a = self.spec.nodes[node]
        for ns, dev in ((a.netns, NODE_IF), (self.spec.switch, a.port)):
            run_cmd(["tc", "-n", ns, "filter", "del", "dev", dev, "parent", "1:", "prio",
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
            s = json.loads(run_cmd(["ip", "-n", n.netns, "-j", "-s", "link", "show", "dev",
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
                for q in json.loads(run_cmd(["tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev",
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
