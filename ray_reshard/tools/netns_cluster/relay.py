"""The link relay: carries a node's frames with a delay, jitter and loss. Run as a script
(standard library only: no torch, no Ray), as `Links.impair` starts it."""
import heapq
import random
import select
import signal
import socket
import sys
import time

# ------------------------------------------------------------------ the link relay
def relay(a: str, b: str, delay_s: float, jitter_s: float, loss: float, seed: int) -> int:
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


if __name__ == "__main__":
    raise SystemExit(relay(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]),
                           float(sys.argv[5]), int(sys.argv[6])))
