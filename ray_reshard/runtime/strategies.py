"""Refit strategies as objects: each says what it supports, prepares a plan on the driver,
compiles one process's program (`install`) and runs it (`execute`). Found by name in
`STRATEGIES`; callers ask the object, never branch on its name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..execution.program import compile_program, per_item_min_bytes
from ..planning.plan import Plan
from . import executor


class Reshard:
    """Point-to-point buckets of exactly the needed bytes (the planned refit)."""

    name = "reshard"
    delta = True                # sends network buckets as deltas when asked
    rings = True                # processes of one node exchange over shared-memory rings

    def prepare(self, plan: Plan, bucket_bytes: int, deadline: Optional[float] = None) -> None:
        """Driver side, before the plan ships: the network buckets' turns (computed once)."""
        plan.network_turns(bucket_bytes, deadline)

    def install(self, plan: Plan, wg, transfers=None):
        """This process's compiled program (`execution.program.Program`)."""
        return compile_program(plan, wg.endpoints, wg.bucket_bytes, wg.ep_pid, transfers,
                               per_item_min_bytes(wg.device.type))

    def ring_bytes(self, compiled) -> dict:
        """{peer process: the largest bucket this process sends it outside the network}."""
        return dict(compiled.max_ring_bytes)

    def execute(self, wg, compiled, views: dict, deadline: float, token: Any = None,
                delta=None) -> dict:
        return executor.run_program(compiled, views, executor.transports(wg), deadline,
                                    token, delta)


@dataclass
class GatherBroadcastProgram:
    """One process's gather-broadcast: the plan and its collective steps."""

    plan: Plan
    gb_steps: list


class GatherBroadcast:
    """The baseline: all-gather each tensor on the sources, broadcast it whole."""

    name = "gather_broadcast"
    delta = False
    rings = False

    def prepare(self, plan: Plan, bucket_bytes: int, deadline: Optional[float] = None) -> None:
        pass

    def install(self, plan: Plan, wg, transfers=None) -> GatherBroadcastProgram:
        """This process's collective steps; every member creates the same sub-groups in the
        same order."""
        from .gather_broadcast import build_steps
        me = wg.ep_pid[next(iter(wg.endpoints))]
        steps = build_steps(plan, wg.ep_pid, me, wg.bucket_bytes)
        if wg.pg is not None:
            for ranks in sorted({g for s in steps for g in s.groups}):
                if me in ranks and len(ranks) > 1:
                    wg.pg.subgroup(ranks)
        return GatherBroadcastProgram(plan, steps)

    def ring_bytes(self, compiled) -> dict:
        return {}

    def execute(self, wg, compiled, views: dict, deadline: float, token: Any = None,
                delta=None) -> dict:
        if delta is not None:
            raise ValueError("the gather_broadcast strategy sends whole tensors: no delta refits")
        from .gather_broadcast import execute
        return execute(wg, compiled, views, deadline)


STRATEGIES = {s.name: s for s in (Reshard(), GatherBroadcast())}
