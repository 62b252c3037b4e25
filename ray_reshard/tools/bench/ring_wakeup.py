"""Shared-memory ring wake-up: futex wake-ups vs sleeping with back-off, side by side.

Two processes ping-pong small messages over a pair of rings; the peer is busy 2 ms before each
reply, so the waiting side is past its spin and asleep when the reply is published. Printed: how
long after the publish the waiter has it (median, p90), and the waiter's CPU seconds.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import struct
import time

from ray_reshard.tools.cli_args import Parser


def _peer(out_name: str, back_name: str, rounds: int, busy_s: float) -> None:
    from ray_reshard.runtime.transport.shm import ShmRing

    inn, back = ShmRing.attach(out_name), ShmRing.attach(back_name)
    for _ in range(rounds):
        inn.recv_slot(time.monotonic() + 30)
        inn.release_recv()
        t_end = time.perf_counter() + busy_s
        while time.perf_counter() < t_end:
            pass
        slot = back.send_slot(8, time.monotonic() + 30)
        slot.numpy()[:8] = memoryview(struct.pack("d", time.perf_counter())).cast("B")
        back.commit_send()


def _measure(futex: bool, rounds: int, busy_s: float) -> tuple[float, float, float]:
    if futex:
        os.environ.pop("RAY_RESHARD_SHM_NO_FUTEX", None)
    else:
        os.environ["RAY_RESHARD_SHM_NO_FUTEX"] = "1"
    # A fresh process per mode: the futex choice is made once per process.
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_waiter, args=(rounds, busy_s, results))
    proc.start()
    got = results.get(timeout=120)
    proc.join()
    return got


def _waiter(rounds: int, busy_s: float, results) -> None:
    from ray_reshard.runtime.transport.shm import ShmRing

    out, back = ShmRing.create(64, 2), ShmRing.create(64, 2)
    try:
        peer = mp.get_context("fork").Process(target=_peer,
                                              args=(out.name, back.name, rounds, busy_s))
        peer.start()
        lat = []
        cpu0 = time.process_time()
        for _ in range(rounds):
            out.send_slot(8, time.monotonic() + 30)
            out.commit_send()
            slot = back.recv_slot(time.monotonic() + 30)
            now = time.perf_counter()
            lat.append(now - struct.unpack("d", bytes(slot.numpy()[:8]))[0])
            back.release_recv()
        cpu = time.process_time() - cpu0
        peer.join()
    finally:
        for r in (out, back):
            r.close()
            ShmRing.unlink(r.name)
    lat.sort()
    results.put((statistics.median(lat), lat[int(0.9 * (len(lat) - 1))], cpu))


def main(argv=None) -> int:
    ap = Parser(prog="ray_reshard bench-ring-wakeup",
                description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--busy-ms", type=float, default=2.0)
    args = ap.parse_args(argv)
    busy = args.busy_ms / 1e3
    print(f"{args.rounds} round trips, the peer busy {args.busy_ms:g} ms before each reply")
    head = f"{'waiting by':<22} {'median us':>9} {'p90 us':>9} {'waiter CPU s':>12}"
    print(head)
    print("-" * len(head))
    for label, futex in (("futex wake-up", True), ("sleep with back-off", False)):
        med, p90, cpu = _measure(futex, args.rounds, busy)
        print(f"{label:<22} {med * 1e6:>9.1f} {p90 * 1e6:>9.1f} {cpu:>12.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
