"""The network transport on CPU (gloo) in real processes: waits honour the deadline, an abort in
one process wakes peers blocked in other processes, set-up needs no collective."""
from __future__ import annotations

import datetime
import time

import pytest
import ray
import torch

from ray_reshard.errors import TransportError, TransportTimeout
from ray_reshard.runtime.transport import torch_pg


@ray.remote(num_cpus=0)
class Member:
    def join(self, world, rank, name):
        self.g = torch_pg.TorchPGGroup(world, rank, name, rendezvous_timeout_s=60)
        return rank

    def recv_from(self, peer, left_s):
        """Post a receive nobody answers; (exception type, message, seconds until it ended)."""
        t0 = time.monotonic()
        work = self.g.irecv(torch.zeros(4), peer)
        try:
            torch_pg.wait(work, time.monotonic() + left_s, f"recv from process {peer}")
        except TransportError as e:
            return type(e).__name__, str(e), time.monotonic() - t0
        return "completed", "", time.monotonic() - t0

    def abort(self, reason, after_s):
        time.sleep(after_s)
        self.g.abort(reason)
        return self.g.aborted

    def exchange(self, peer, value):
        """One message each way with `peer` (lower rank sends first)."""
        out, got = torch.full((8,), float(value)), torch.zeros(8)
        dl = time.monotonic() + 30
        if self.g.rank < peer:
            torch_pg.wait(self.g.isend(out, peer), dl, "send")
            self.g.irecv(got, peer).wait(datetime.timedelta(seconds=30))   # torch-style too
        else:
            torch_pg.wait(self.g.irecv(got, peer), dl, "recv")
            self.g.isend(out, peer).wait()
        return got.tolist()

    def grouped_exchange(self, peers, value):
        """A message to and from every peer posted as one group, the group's handle waited
        twice (the executor waits a group once per message it holds)."""
        out = torch.full((8,), float(value))
        got = {p: torch.zeros(8) for p in peers}
        ops = [(p, out, True) for p in peers] + [(p, got[p], False) for p in peers]
        handle = self.g.post_group(ops)
        dl = time.monotonic() + 30
        torch_pg.wait(handle, dl, "group")
        t0 = time.monotonic()
        torch_pg.wait(handle, dl, "group again")
        return {p: t[0].item() for p, t in got.items()}, time.monotonic() - t0

    def leave(self):
        self.g.destroy_group()

    def store_address(self):
        return self.g.store_address


@pytest.fixture(scope="module")
def processes(cluster):
    """Three actor processes; each test builds a fresh group over some of them."""
    return [Member.remote() for _ in range(3)]


def _group(processes, n):
    name = f"pgtest-{time.monotonic_ns()}"
    members = processes[:n]
    ray.get([m.join.remote(n, r, name) for r, m in enumerate(members)], timeout=90)
    return members


def test_exchange_then_abort_wakes_blocked_peers_in_other_processes(processes):
    members = _group(processes, 3)
    got = ray.get([members[0].exchange.remote(1, 7), members[1].exchange.remote(0, 9)], timeout=60)
    assert got == [[9.0] * 8, [7.0] * 8]
    # process 1 waits for process 2 (alive, but never sends) and process 2 for process 0, with
    # a deadline far away; process 0 aborts: both must wake within about a second, with the
    # reason (process 2 first sees its connection to process 0 close).
    blocked = members[1].recv_from.remote(2, 60.0)
    also_blocked = members[2].recv_from.remote(0, 60.0)
    time.sleep(0.5)
    assert ray.get(members[0].abort.remote("dst rank 3 ran out of memory", 0.0)) == \
        "dst rank 3 ran out of memory"
    for ref in (blocked, also_blocked):
        kind, msg, secs = ray.get(ref, timeout=30)
        assert kind == "TransportError", (kind, msg)
        assert "dst rank 3 ran out of memory" in msg
        assert secs < 0.5 + 2.5, secs
    ray.get([m.leave.remote() for m in members])


def test_post_group_exchanges_with_every_peer_and_waits_once(processes):
    members = _group(processes, 3)
    got = ray.get([m.grouped_exchange.remote([p for p in range(3) if p != r], 10 + r)
                   for r, m in enumerate(members)], timeout=60)
    for r, (values, again_s) in enumerate(got):
        assert values == {p: 10.0 + p for p in range(3) if p != r}
        assert again_s < 1.0             # already complete: no second wait on the works
    ray.get([m.leave.remote() for m in members])


def test_wait_honours_little_or_no_time_left(processes):
    members = _group(processes, 2)
    kind, msg, secs = ray.get(members[0].recv_from.remote(1, 0.0), timeout=30)
    assert kind == "TransportTimeout" and secs < 1.0
    # under 1 ms left: Work.wait reads a zero timeout as "none" (the group's 30 min default)
    kind, msg, secs = ray.get(members[1].recv_from.remote(0, 0.0005), timeout=30)
    assert kind in ("TransportTimeout", "TransportError") and secs < 2.0, (kind, msg, secs)
    ray.get([m.leave.remote() for m in members])


def test_module_wait_on_a_plain_work_with_no_time_left():
    class Never:
        def wait(self, timeout=None):
            raise AssertionError("must not wait")
    with pytest.raises(TransportTimeout):
        torch_pg.wait(Never(), time.monotonic() - 1, "x")


@ray.remote(num_cpus=0)
class NCCLEnvProbe:
    """Builds a one-rank TorchNCCLGroup on CPU with torch's ProcessGroupNCCL replaced by a
    recorder, to see the environment torch's constructor reads (this process only)."""

    def build(self, name, user_env):
        import os

        seen = {}

        class Recorder:
            class Options:
                pass

            def __init__(self, store, rank, size, opts):
                seen.update({k: os.environ.get(k) for k in user_env})

            def eager_connect_single_device(self, device):
                pass

        os.environ.update(user_env)
        torch.distributed.ProcessGroupNCCL = Recorder
        torch.cuda.current_device = lambda: 0
        g = torch_pg.TorchNCCLGroup(1, 0, name, rendezvous_timeout_s=30)
        after = {k: os.environ.get(k) for k in user_env}
        g.destroy_group()
        return seen, after


def test_nccl_groups_are_built_to_keep_the_process_on_errors(cluster):
    """torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING when a ProcessGroupNCCL is built: 3 (its
    default) kills the process on an NCCL error or timeout, 2 aborts the communicators and
    keeps it. Our group's constructor sees 2 and no heartbeat monitor; the process's own
    setting (the trainer's or engine's) is back as it was afterwards."""
    user = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1"}
    probe = NCCLEnvProbe.remote()
    seen, after = ray.get(probe.build.remote(f"ncclenv-{time.monotonic_ns()}", user), timeout=90)
    assert seen == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert after == user
    ray.kill(probe)


SURVIVOR = """
import sys, time, torch, ray
from ray_reshard.runtime.transport import torch_pg
torch_pg.NCCL_GROUP_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = sys.argv[1]
ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False)
g = torch_pg.TorchNCCLGroup(1, 0, "survivor", timeout_s=3, rendezvous_timeout_s=60)
work = g.irecv(torch.zeros(4, device=g.device), 0)      # nobody sends: NCCL times out
time.sleep(15)                                          # torch's watchdog acts meanwhile
print("alive", flush=True)
"""


@pytest.mark.gpu
def test_process_survives_an_nccl_timeout(tmp_path):
    """A receive nobody answers times out inside NCCL: with our setting (2) the process lives
    on; with torch's default (3) the watchdog kills it, so the check can tell them apart."""
    import subprocess
    import sys
    script = tmp_path / "survivor.py"
    script.write_text(SURVIVOR)
    ours = subprocess.run([sys.executable, str(script), "2"], capture_output=True, text=True,
                          timeout=240)
    assert ours.returncode == 0 and "alive" in ours.stdout, ours.stderr[-2000:]
    torch_default = subprocess.run([sys.executable, str(script), "3"], capture_output=True,
                                   text=True, timeout=240)
    assert torch_default.returncode != 0 and "alive" not in torch_default.stdout


def test_losing_the_store_host_wakes_the_others(cluster):
    """Process 0 hosts the group's store; when it dies (SIGKILL: it writes nothing), a process
    blocked on a live peer still ends its wait within about a second."""
    members = [Member.remote() for _ in range(3)]
    name = f"pgtest-{time.monotonic_ns()}"
    ray.get([m.join.remote(3, r, name) for r, m in enumerate(members)], timeout=90)
    blocked = members[1].recv_from.remote(2, 60.0)
    time.sleep(0.5)
    ray.kill(members[0])
    kind, msg, secs = ray.get(blocked, timeout=30)
    assert kind == "TransportError" and "store" in msg, (kind, msg)
    assert secs < 0.5 + 3.0, secs
    ray.get(members[2].leave.remote())


def test_nccl_error_cause_survives_on_the_first_line():
    class Failed:
        def wait(self, timeout=None):
            raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, internal error - "
                               "please report this issue to the NCCL developers, NCCL version "
                               "2.27.3\nncclInternalError: Internal check failed.\nLast error:\n"
                               "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device "
                               "1a000")
    with pytest.raises(TransportError) as info:
        torch_pg.wait(Failed(), time.monotonic() + 5, "recv from process 1")
    first = str(info.value).splitlines()[0]
    assert first.startswith("recv from process 1: NCCL error in")
    assert "Duplicate GPU detected : rank 1 and rank 0" in first
    assert "ncclInternalError" in first


def test_abort_from_outside_the_group_wakes_blocked_members(processes):
    """The driver (not a member) aborts through the group's store, as it does when a member
    died: members blocked on a live peer wake within about a second, with the reason."""
    members = _group(processes, 2)
    name = ray.get(members[0].__ray_call__.remote(lambda self: self.g.group_name))
    address = ray.get(members[0].store_address.remote())
    blocked = [members[0].recv_from.remote(1, 60.0), members[1].recv_from.remote(0, 60.0)]
    time.sleep(0.5)
    assert torch_pg.abort_group(address, name, "process 2 died during run")
    for ref in blocked:
        kind, msg, secs = ray.get(ref, timeout=30)
        assert kind == "TransportError" and "process 2 died during run" in msg, (kind, msg)
        assert secs < 0.5 + 3.0
    ray.get([m.leave.remote() for m in members])
    assert not torch_pg.abort_group(("127.0.0.1", 1), name, "nobody listens", timeout_s=0.5)
