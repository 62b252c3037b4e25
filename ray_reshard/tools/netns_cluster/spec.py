"""What a box is made of (names, addresses, rates) and the checks and commands every part of it
uses."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional

PREFIX = "rrbox"
SPEC_ENV = "RRBOX_SPEC"          # set in the driver's environment: the box it runs in
NODE_IF = f"{PREFIX}-eth"        # each node's end of its link (GLOO_SOCKET_IFNAME)
BRIDGE = f"{PREFIX}-br"
SUBNET = "10.77.0"               # inside the box's own bridge only: node i is .(10 + i)
HEAD_PORT = 6379
BURST = "256kb"                  # tc token bucket depth per link
STATE_DIR = "/run/rrbox" if os.path.isdir("/run") else os.path.join(tempfile.gettempdir(),
                                                                    "rrbox-state")
QUANTUM = 60000                 # htb bytes per round: above one 64 KB offload segment's
DROP_CLASS = "1:99"             # every link's class whose queue holds nothing (partitions)


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
    r = run_cmd(["ip", "netns", "add", probe], check=False)
    if r.returncode:
        return f"`ip netns add` failed: {(r.stderr or r.stdout).strip().splitlines()[-1]}"
    run_cmd(["ip", "netns", "del", probe], check=False)
    return None


def run_cmd(cmd, check: bool = True, timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
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


def make_spec(box_id: str, nodes: int, rate: str, mtu: int) -> Spec:
    base = f"{PREFIX}-{box_id}"
    return Spec(box_id, f"{base}-sw",
                tuple(Node(i, f"{base}-n{i}", f"{SUBNET}.{10 + i}", f"{PREFIX}-p{i}")
                      for i in range(nodes)),
                os.path.join(tempfile.gettempdir(), base), rate, mtu)


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


def log_tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-4000:]
    except OSError:
        return ""
    return " | ".join(ln.strip() for ln in text.strip().splitlines()[-lines:])

