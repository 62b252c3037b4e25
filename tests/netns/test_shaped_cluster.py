"""Refits on a real multi-node Ray cluster whose nodes sit in network namespaces behind links
shaped to 1 Gbit/s (ray_reshard.tools.netns_cluster): the bytes each link carried, as the kernel
counts them, against what the plan and the result say; and network faults on a link.

One box of 3 nodes serves the whole module (starting one takes about 20 s); its driver runs
the functions of box_calls.py inside the head's namespace.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ray_reshard.tools import netns_cluster
from ray_reshard.tools.netns_cluster import NetnsCluster, leftovers, unavailable

CALLS = os.path.join(os.path.dirname(__file__), "box_calls.py")
# What a link carries beyond the payload: one set of headers per 64 KB offload segment as the
# veth counts them (+0.13%), acknowledgements, and the Ray control traffic of a refit.
WIRE_OVERHEAD = 0.05


def call(driver, name, **kwargs):
    return driver.call(f"{CALLS}:{name}", call_timeout_s=300, **kwargs)


@pytest.fixture(scope="module")
def box():
    why = unavailable()
    if why:
        pytest.skip(f"no cluster in a box here: {why}")
    b = NetnsCluster(nodes=3, rate="1gbit")
    b.start()
    b.driver_ = b.driver()
    yield b
    b.close()


def test_cluster_in_a_box(box):
    """Three Ray nodes, each in its own namespace with one shaped link and its own address;
    gloo uses that link; nothing of the box shows in the root namespace."""
    got = call(box.driver_, "info")
    ips = [n.ip for n in box.spec.nodes]
    assert got["nodes"] == {ip: [f"node{i}"] for i, ip in enumerate(ips)}
    assert [o["ip"] for o in got["on_node"]] == ips
    assert all(o["gloo_if"] == got["node_if"] for o in got["on_node"])
    assert got["driver_gloo_if"] == got["node_if"]
    assert got["ifaces"] == {str(i): sorted(["lo", got["node_if"]]) for i in range(3)}
    assert got["rates"] == ["1Gbit"] * 3
    assert leftovers()["links"] == []        # the bridge and links live in the box's namespaces


@pytest.mark.parametrize("kind", ["dense", "delta", "gather_broadcast"])
def test_wire_bytes_equal_reported(box, kind):
    """What each link carried during one refit (kernel counters) equals what the result
    reports as network bytes, within protocol overhead; for reshard also what the plan says
    leaves node 0 and enters node 1; the third node's link carries control traffic only, and
    every byte that left a node entered another (nothing crossed but on the links)."""
    got = call(box.driver_, "wire", kind=kind)
    assert got["exact"], got
    carried, reported = got["carried"], got["reported"]["network"]
    into, out_of = carried["1"]["rx_bytes"], carried["0"]["tx_bytes"]
    assert reported <= into <= reported * (1 + WIRE_OVERHEAD), got
    assert reported <= out_of <= reported * (1 + WIRE_OVERHEAD), got
    if kind != "gather_broadcast":
        assert got["expect_rx"]["1"] == got["expect_tx"]["0"] == got["plan_network_bytes"]
        if kind == "dense":
            assert reported == got["plan_network_bytes"]
        else:                                  # 10% of the elements changed: fewer bytes
            assert reported < 0.3 * got["plan_network_bytes"]
    else:                                      # gloo's tree relays one copy inside node 1
        assert reported == 3 * got["plan_network_bytes"]
    assert carried["2"]["rx_bytes"] + carried["2"]["tx_bytes"] < 0.01 * reported
    sent = sum(c["tx_bytes"] for c in carried.values())
    received = sum(c["rx_bytes"] for c in carried.values())
    assert abs(sent - received) <= 0.001 * received + 64 * 1024, carried


def test_no_refit_beats_the_link(box):
    """The shaping holds: a refit takes at least its network bytes over the link's rate."""
    got = call(box.driver_, "lower_bound_check")
    assert got["seconds"] >= 0.97 * got["bound_s"], got


@pytest.mark.parametrize("kind, mb, timeout_s", [("down", 16, 6.0), ("partition", 16, 6.0),
                                                 ("delay", 2, 30.0), ("loss", 16, 30.0)])
def test_network_fault(box, kind, mb, timeout_s):
    """A link taken down mid-refit or a node cut off from the head: RefitError naming the
    unreachable processes within the deadline + 5 s, the atomic destinations keep their old
    weights, every member agrees on the version, and once the link is back the next refit on
    the same group is exact. 200 ms of delay or 2% loss each way: the refit completes exactly."""
    got = call(box.driver_, "fault", kind=kind, mb=mb, count=16, timeout_s=timeout_s)
    v = got["version_before"]
    if kind in ("down", "partition"):
        assert "error" in got and got["error"].startswith("RefitError"), got
        assert got["seconds"] <= timeout_s + 5, got
        assert sorted(map(tuple, got["failed_ranks"])) == [("dst", 2), ("dst", 3)], got
        assert "process 6 did not finish" in got["error"] and \
            "process 7 did not finish" in got["error"], got
        assert got["holds_old"] == [True] * 4 and got["holds_new"] == [False] * 4, got
        assert got["versions"] == [v] * 8 and got["group_version"] == v, got
        assert got["next"]["version"] == v + 1 and got["next"]["holds_new"] == [True] * 4, got
        assert any("re-formed" in w for w in got["next"]["warnings"]), got
    else:
        assert got.get("version") == v + 1, got
        assert got["holds_new"] == [True] * 4, got
        assert got["versions"] == [v + 1] * 8, got
        assert got["next"]["version"] == v + 2 and got["next"]["holds_new"] == [True] * 4, got


def test_driver_reports_errors(box):
    with pytest.raises(netns_cluster.DriverError, match="ValueError: no such weight"):
        call(box.driver_, "fails", text="no such weight")


def test_without_root_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = unavailable()
    assert why and "\n" not in why and "root" in why


def test_box_of_a_killed_owner_is_removed():
    """A process that made a box and was SIGKILLed leaves it behind; the next start (here
    `clean_leftovers`) removes its namespaces, links, directory and processes."""
    if unavailable():
        pytest.skip(unavailable())
    script = ("import sys, time\n"
              "from ray_reshard.tools.netns_cluster import NetnsCluster\n"
              "b = NetnsCluster(nodes=2, with_ray=False).start()\n"
              "b.popen(1, ['sleep', '600'])\n"
              "print(b.spec.box_id, flush=True)\n"
              "time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    box_id = owner.stdout.readline().strip()
    assert box_id, "the owner did not start its box"
    mine = lambda: {k: [x for x in v if box_id in str(x)] for k, v in leftovers().items()
                    if k != "processes"}
    assert mine()["netns"], "the box was not made"
    ns_pids = [p for p in leftovers()["processes"]
               if "sleep" in open(f"/proc/{p}/cmdline").read()]
    assert ns_pids, "the process in the box should run"
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert box_id in netns_cluster.clean_leftovers()
    assert mine() == {"netns": [], "links": [], "dirs": []}
    time.sleep(0.2)
    assert not [p for p in ns_pids if alive(p)]


def test_teardown_after_the_driver_was_killed(box):
    """Last: the driver SIGKILLed mid-life; close() still leaves no namespace, link,
    directory or Ray process of the box."""
    pids = box.pids()
    assert box.driver_.pid in pids and len(pids) > 10, "the driver and Ray run in the box"
    os.kill(box.driver_.pid, signal.SIGKILL)
    box.close()
    left = leftovers()
    assert not [n for n in left["netns"] if box.spec.box_id in n], left
    assert not [d for d in left["dirs"] if box.spec.box_id in d], left
    assert not [p for p in pids if alive(p)], "processes outlived the box"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
