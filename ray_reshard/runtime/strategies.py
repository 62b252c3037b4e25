"""Refit strategies as objects: each compiles a process's program (`install`) and runs it
(`execute`); looked up by name in `STRATEGIES`."""
from __future__ import annotations

from typing import Any

from ..planning.plan import Plan
from ..execution.program import Program, compile_program, per_item_min_bytes
from . import executor


class Reshard:
    """Point-to-point buckets of exactly the needed bytes (the planned refit)."""

    name = "reshard"

    def install(self, plan: Plan, endpoints, bucket_bytes: int, proc_of: dict, pg=None,
                transfers=None, device_type: str = "cpu") -> Program:
        return compile_program(plan, endpoints, bucket_bytes, proc_of, transfers,
                               per_item_min_bytes(device_type))

    def execute(self, wg, prog, views: dict, deadline: float, token: Any = None,
                delta=None) -> dict:
        return executor.run_program(prog.compiled, views, executor.transports(wg), deadline,
                                    token, delta)


class GatherBroadcast:
    """The baseline: all-gather each tensor on the sources, broadcast it whole."""

    name = "gather_broadcast"

    def install(self, plan: Plan, endpoints, bucket_bytes: int, proc_of: dict, pg=None,
                transfers=None, device_type: str = "cpu"):
        from .gather_broadcast import build_steps
        me = proc_of[next(iter(endpoints))]
        steps = build_steps(plan, proc_of, me, bucket_bytes)
        if pg is not None:
            # Every member creates the same sub-groups in the same order.
            for ranks in sorted({g for s in steps for g in s.groups}):
                if me in ranks and len(ranks) > 1:
                    pg.subgroup(ranks)
        return steps

    def execute(self, wg, prog, views: dict, deadline: float, token: Any = None,
                delta=None) -> dict:
        if delta is not None:
            raise ValueError("the gather_broadcast strategy sends whole tensors: no delta refits")
        from .gather_broadcast import execute
        return execute(wg, prog, views, deadline)


STRATEGIES = {s.name: s for s in (Reshard(), GatherBroadcast())}
