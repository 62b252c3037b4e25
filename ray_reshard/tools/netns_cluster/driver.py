"""The driver: a Python process inside the head node's namespace, connected to the box's Ray
cluster, calling functions by name with JSON in and out."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import time
import traceback
from typing import Any, Protocol

from .spec import SPEC_ENV, Spec, log_tail


class Box(Protocol):
    """What the driver reads of its box (`box.NetnsCluster`, which starts the driver)."""

    spec: Spec
    nodes: int
    start_timeout_s: float

    def node_env(self, index: int) -> dict: ...


# ------------------------------------------------------------------ the driver
class DriverError(RuntimeError):
    """A function called in the driver raised: its type, message and traceback."""


class Driver:
    """A Python process in the head node's namespace, connected to the box's Ray cluster.

    `call("package.module:function", **kwargs)` (or "path/to/file.py:function") runs the
    function there and returns what it returned (JSON-able); `start(...)` returns a
    `PendingCall` so this process can change the links while it runs. One call at a time.
    """

    def __init__(self, box: Box, echo: bool = False, index: int = 0):
        spec = box.spec
        req_r, self._req_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        self.log_path = os.path.join(spec.tmp, f"driver-{index}.log")
        out = None if echo else open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            ["ip", "netns", "exec", spec.head.netns, sys.executable, "-m",
             "ray_reshard.tools.netns_cluster", "serve", str(req_r), str(resp_w), str(box.nodes)],
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
                                      f"{log_tail(self.log_path)}")
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


def serve(fd_in: int, fd_out: int, nodes: int) -> int:
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
