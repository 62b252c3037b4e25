"""A refit's protocol on the driver: start every process's run, collect the results and name
the ranks at fault, commit (atomic refits) or roll back, and recover after a failure."""
from __future__ import annotations

import time
import warnings
from typing import Mapping, Optional

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from ..errors import GroupStateLost, RefitError, TransportError
from ..planning.plan import check_spec_set
from . import membership, worker
from .delta import request as delta_request, summarize as delta_summary
from .membership import actor_key
from .result import RefitResult
from .transport import torch_pg


class RefitProtocol:
    """The part of a ReshardGroup that runs a refit's phases (a mix-in of ReshardGroup): it
    reads the group's membership and programs and keeps `_broken`, `_recoverable` and
    `_hung`, what a failure left behind."""

    def _recover(self, timeout: Optional[float]) -> str:
        """A refit failed earlier. Where no member died or lost its state in it and every
        member answers within RECOVER_PROBE_S (the network is back, a busy member is free),
        re-form the collective group and programs with the same actors, as update() does, and
        return a note for the result's warnings; otherwise refuse, naming the failure."""
        refuse = RefitError(f"this ReshardGroup failed earlier ({self._broken}); call update() "
                            f"(same or replacement actors) or build a new one")
        if not self._recoverable:
            raise refuse
        refs = [a.__ray_call__.remote(worker.probe) for a in self._procs]
        ready, _ = ray.wait(refs, num_returns=len(refs),
                            timeout=min(RECOVER_PROBE_S, timeout or RECOVER_PROBE_S))
        if len(ready) < len(refs):
            raise refuse
        try:
            pids = [info["pid"] for info in ray.get(refs)]
        except Exception:       # noqa: BLE001  (died since: the refusal names the failure)
            raise refuse from None
        if any(pid != self._infos.get(actor_key(a), {}).get("pid")
               for a, pid in zip(self._procs, pids)):
            raise refuse        # restarted by Ray: its shards and group state are gone
        why, t0 = self._broken, time.perf_counter()
        self.update()
        return (f"the collective group was re-formed with the same actors "
                f"({time.perf_counter() - t0:.2f} s) after a refit failed: {why[:300]}")

    def _settle(self) -> None:
        """Finish an overlapped refit still in flight (its errors stay with its handle)."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is not None:
            try:
                pending.wait()
            except Exception:
                pass

    def _refit(self, specs, atomic, snapshot, timeout_s, delta=False) -> RefitResult:
        self._settle()
        return self._finish(self._start(specs, atomic, snapshot, timeout_s, delta=delta))

    def _start(self, specs, atomic, snapshot, timeout_s, capture: bool = False,
               delta: bool = False) -> dict:
        """Plan, install, validate, (capture,) and start every process's run."""
        self._check_usable()
        recovered = self._recover(timeout_s or self.timeout_s) if self._broken else None
        if not isinstance(specs, Mapping) or not specs:
            check_spec_set(specs)                 # each entry: when the set is new (planning)
        check_timeout(timeout_s)
        delta = delta_request(delta, specs, self.delta_baseline)
        if delta is not None and not self._strategy.delta:
            raise ValueError(f"delta refits need the reshard strategy (this group uses "
                             f"{self.strategy!r}, which sends whole tensors)")
        if delta is not None and not self._delta_ready:
            # A compiler run (the delta codec's first build on a host) is setup, not refit:
            # under the setup timeout, once per membership, before this refit's deadline.
            self._collect([a.__ray_call__.remote(worker.prepare_delta, self.group_id)
                           for a in self._procs], self.setup_timeout_s, "delta codec")
            self._delta_ready = True
        # One deadline for the whole refit: sizing and planning a new spec set, installing its
        # programs, checking local tensors, and running. A dead or stuck rank fails it in
        # time, named. Without a timeout it follows the payload: the plan's, once known.
        t_start = time.monotonic()
        timeout = timeout_s or self.timeout_s
        key, p, planned = self._cached_plan(specs, lambda: t_start + (
            timeout or default_timeout_s(sum(s.source_nbytes for s in specs.values()))))
        timeout = timeout or default_timeout_s(p.stats.total_bytes)
        deadline = t_start + timeout
        self._install(key, p, timeout)
        version = self._version + 1
        t0 = time.perf_counter()
        if capture:
            holders = self.members.procs_of("src")
            try:
                errors = self._collect([self._procs[q].__ray_call__.remote(
                    worker.capture, self.group_id, key, self._version) for q in holders],
                    max(deadline - time.monotonic(), 0.0), "capture", holders)
            except RefitError:
                self._discard_all()
                raise
            if any(errors):
                self._discard_all()
                self._refuse(errors)
        left = max(deadline - time.monotonic(), 0.001)
        # One call per process: it checks its tensors, votes with the others through the
        # group's store (nobody moves a byte unless everyone's tensors are right), and runs.
        ballot = f"refit{next(self._ballots)}"
        refs = [a.__ray_call__.remote(worker.run, self.group_id, key, left, version, atomic,
                                      snapshot, ballot, self._version, delta)
                for a in self._procs]
        return {"refs": refs, "left": left, "version": version, "timeout": timeout, "t0": t0,
                "plan": p, "planned": planned, "atomic": atomic, "recovered": recovered}

    def _finish(self, running: dict) -> RefitResult:
        """Wait for every process's run, commit, and report."""
        try:
            per = self._collect(running["refs"], running["left"])
        except RefitError:
            self._discard_all()
            if not running["atomic"]:           # destinations may hold a mix of versions
                for a in self.dst_actors:
                    self._unsure.setdefault(actor_key(a), (
                        f"refit v{running['version']} failed part-way (not atomic): it may "
                        f"hold a mix of v{self._version} and v{running['version']}"))
            raise
        version, p = running["version"], running["plan"]
        if any("refused" in st for st in per):
            self._discard_all()
            self._refuse(per)
        if any(st.get("delta", {}).get("mismatches") for st in per):
            self._delta_mismatch(running, per)
        if running["atomic"]:
            result_warnings = self._commit(version, running["timeout"])
        else:                  # every process finished: each takes the version at its next call
            self._version, result_warnings = version, []
        for a in self.dst_actors:
            self._unsure.pop(actor_key(a), None)
        if running.get("recovered"):
            result_warnings = [running["recovered"], *result_warnings]
        seconds = time.perf_counter() - running["t0"]
        moved = {"network": 0, "domain": 0, "local": 0}
        for st in per:
            for k, v in st["bytes_by_path"].items():
                moved[k] += v
        return RefitResult(version, seconds, self.strategy, moved,
                           moved["network"] / seconds / 1e9 if seconds > 0 else 0.0,
                           max(st["peak_staging_bytes"] for st in per),
                           max(st["extra_bytes"] for st in per), p.stats, running["planned"],
                           per, result_warnings, delta_summary(per))

    def _refuse(self, per: list) -> None:
        """Raise for a refit every process refused before moving any byte (`per`: what each
        reported): a RefitError naming the ranks whose own code raised (the first exception
        its cause), else a ValueError listing every problem found."""
        faults = [st for st in per if st and st.get("fault")]
        if faults:
            ranks = self._ranks_of([st["pid"] for st in faults])
            raise RefitError(
                "refit refused before moving any byte: a fault in the actors' code on "
                f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: "
                + "; ".join(st["fault"]["text"] for st in faults)
                + "; every destination is as it was, and the group stays usable",
                ranks) from faults[0]["fault"]["error"]
        refuse_problems([st.get("refused", []) for st in per if st])

    def _delta_mismatch(self, running: dict, per: list) -> None:
        """Raise for a delta refit whose bytes did not match on some receivers (their
        destinations were written outside refits). Every process finished, nothing is broken:
        the group stays usable; the destinations' bytes are unknown until the next refit, which
        sends dense to them (the refit's baselines are not confirmed)."""
        self._discard_all()
        bad = [st for st in per if st.get("delta", {}).get("mismatches")]
        for st in (per if not running["atomic"] else bad):
            for side, r in self._ranks_of([st["pid"]]):
                if side == "dst":
                    self._unsure[actor_key(self.dst_actors[r])] = (
                        f"delta refit v{running['version']} did not match on a receiver "
                        f"(destination shards written outside refits): its bytes are unknown "
                        f"until the next refit")
        ranks = self._ranks_of([st["pid"] for st in bad])
        raise RefitError(
            f"delta refit v{running['version']} failed on "
            f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: "
            + "; ".join(m for st in bad for m in st["delta"]["mismatches"])
            + f"; the group stays usable at v{self._version}: the next refit sends dense "
              f"where a receiver's bytes are unknown", ranks)

    def _discard_all(self) -> None:
        if not self._ray_alive():       # nothing left to tell: the actors went with Ray
            return
        for a in self._procs:
            a.__ray_call__.remote(worker.discard, self.group_id, self._version)

    def _commit(self, version: int, timeout: float) -> list:
        """Every rank has everything: make `version` every process's, one truth for all.

        What matters is the destinations: when every process holding a destination commits,
        the refit is done and the group's version advances (a source-only process that died
        after its data moved only needs update() before the next refit: a warning). When a
        destination fails here, the others roll back (atomic: old weights back) and the group
        keeps its version.
        """
        dst_procs = set(self.members.procs_of("dst"))
        refs = [a.__ray_call__.remote(worker.commit, self.group_id, version)
                for a in self._procs]
        grace = 5.0
        ready, _ = self._wait(refs, len(refs), timeout + grace)
        ready = set(ready)
        failed, texts = [], []
        for proc, r in enumerate(refs):
            if r not in ready:
                failed.append(proc)
                self._hung.add(proc)
                texts.append(f"process {proc} did not finish within {timeout:.1f} s (commit)")
                continue
            try:
                self._get(r)
            except (RayActorError, RayTaskError) as e:
                failed.append(proc)
                texts.append(describe_failure(proc, e))
        bad_dst = [p for p in failed if p in dst_procs]
        if bad_dst:
            survivors = [p for p in range(len(self._procs)) if p not in failed]
            ray.wait([self._procs[p].__ray_call__.remote(worker.rollback, self.group_id)
                      for p in survivors], num_returns=len(survivors), timeout=timeout + grace)
            self._broken = "; ".join(texts)
            ranks = self._ranks_of(failed)
            raise RefitError(f"refit failed in commit on "
                             f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: {'; '.join(texts)}"
                             f"; every other process rolled back to v{self._version}", ranks)
        for p in range(len(self._procs)):
            if p not in failed:
                self._procs[p].__ray_call__.remote(worker.release, self.group_id)
        self._version = version
        if not failed:
            return []
        self._broken = "; ".join(texts)
        note = (f"refit v{version} is complete on every destination, but "
                f"{', '.join(f'{s} rank {r}' for s, r in self._ranks_of(failed))} failed after "
                f"its data moved ({'; '.join(texts)}): call update() before the next refit")
        warnings.warn(note, RuntimeWarning, stacklevel=4)
        return [note]

    def _collect(self, refs, timeout: float, phase: str = "run", pids=None) -> list:
        """Results of one call per process (`pids[i]` made `refs[i]`; default: all, in order).

        Waits `timeout` plus a grace period; a process that died, raised or did not answer in
        time fails the refit: RefitError naming its ranks, and the group is marked broken.
        Once one process failed, the others get `SETTLE_S` to report (a failing process aborts
        its channels, which wakes its peers at once); any still busy then count as hung.
        """
        pids = list(range(len(refs))) if pids is None else list(pids)
        grace = 5.0
        t_deadline = time.monotonic() + timeout
        t_end = t_deadline + grace
        index = {r: i for i, r in enumerate(refs)}
        outcome: dict = {}                    # i -> (True, result) or (False, error)
        not_ready = list(refs)
        while not_ready:
            left = t_end - time.monotonic()
            if left <= 0:
                break
            ready, not_ready = self._wait(not_ready, 1, left)
            if not ready:
                continue
            i = index[ready[0]]
            try:
                outcome[i] = (True, self._get(ready[0]))
                continue
            except RefitError:
                raise
            except Exception as e:
                outcome[i] = (False, e)
            now = time.monotonic()
            # Past the deadline, whoever has not answered is hung: no need to settle long.
            t_end = min(t_end, now + (SETTLE_S if now < t_deadline else LATE_SETTLE_S))
            error = outcome[i][1]
            died = isinstance(error, RayActorError)
            if not_ready and pids[i] != 0 and (
                    died or isinstance(getattr(error, "cause", None), GroupStateLost)):
                # A dead process (or one that lost its group state) aborts nothing itself:
                # wake the live ones blocked on it (process 0 hosts the store: its members
                # notice that loss themselves).
                self._abort_members(f"process {pids[i]} "
                                    f"{'died' if died else 'lost its group state'} during {phase}")
        not_ready = set(not_ready)
        results, failed, messages = {}, [], []
        waiting, waiting_msgs = [], []        # failed only because a peer did (transport errors)
        for i, (ok, value) in outcome.items():
            if ok:
                results[i] = value
            elif isinstance(value, RayActorError):
                failed.append(pids[i])
                messages.append(describe_failure(pids[i], value))
            else:
                cause = value.cause if getattr(value, "cause", None) is not None else value
                text = describe_failure(pids[i], value)
                if isinstance(cause, TransportError):
                    waiting.append(pids[i])
                    waiting_msgs.append(text)
                else:
                    failed.append(pids[i])
                    messages.append(text)
        if not not_ready and not failed and not waiting:
            return [results[i] for i in range(len(refs))]
        hung = [pids[i] for i, r in enumerate(refs) if r in not_ready]
        self._hung.update(hung)
        if failed:
            # Others failed on their own first: the unfinished ones are blocked on them (woken
            # late, or stuck in a transport), not at fault.
            waiting_msgs += [f"process {p} still blocked when the refit ended" for p in hung]
            hung = []
        for p in hung:
            messages.append(f"process {p} did not finish within {timeout:.1f} s ({phase})")
        # The ranks at fault: those that died, hung or raised on their own. Ranks whose transfers
        # failed (peer gone, channel aborted, timed out) are named as at fault only when nothing
        # else explains the failure.
        if failed or hung:
            ranks = self._ranks_of(failed + hung)
            if waiting_msgs:
                messages.append("then, waiting on them: " + "; ".join(waiting_msgs))
        else:
            ranks = self._ranks_of(waiting)
            messages = waiting_msgs
        self._broken = "; ".join(messages)
        # Nobody died or lost its group state (a network fault, a member busy past the
        # deadline): the next refit may re-form the group once everyone answers (`_recover`).
        self._recoverable = not any(
            isinstance(v, RayActorError) or isinstance(getattr(v, "cause", None), GroupStateLost)
            for ok, v in outcome.values() if not ok)
        raise RefitError(f"refit failed in {phase} on "
                         f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: "
                         + "; ".join(messages), ranks)

    def _wait(self, refs, num_returns: int, timeout: float):
        """ray.wait in slices of at most a second, ending in a RefitError as soon as the
        group's Ray instance is gone (ray.shutdown() in another thread, a lost connection)."""
        t_end = time.monotonic() + timeout
        while True:
            left = t_end - time.monotonic()
            try:
                if not self._ray_alive():
                    raise SystemExit
                ready, not_ready = ray.wait(refs, num_returns=num_returns,
                                            timeout=max(min(left, 1.0), 0.0))
            except (SystemExit, Exception) as e:
                if self._ray_alive():
                    raise
                raise self._ray_gone() from (None if isinstance(e, SystemExit) else e)
            if len(ready) >= num_returns or left <= 1.0:
                return ready, not_ready

    def _get(self, ref):
        """ray.get of a ready result; a RefitError when the group's Ray instance is gone."""
        try:
            return ray.get(ref)
        except SystemExit:
            if self._ray_alive():
                raise
            raise self._ray_gone() from None

    def _ray_gone(self) -> RefitError:
        self._broken = "its Ray instance went away during a refit"
        return RefitError("the refit was cut short: the Ray instance this group was built on "
                          "went away (ray.shutdown() in another thread, or the driver lost its "
                          "connection); build a new ReshardGroup after ray.init()",
                          [(s, r) for s in ("src", "dst")
                           for r in range(len(self.src_actors if s == "src"
                                              else self.dst_actors))])

    def _abort_members(self, reason: str) -> None:
        """Wake every member blocked in this group's transport (through the group's store)."""
        address = getattr(self, "_store_address", None)
        if address is not None:
            torch_pg.abort_group(address, self.group_name, reason)

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this ReshardGroup is closed")
        if not self._ray_alive():
            raise RuntimeError("the Ray instance this ReshardGroup was built on is gone "
                               "(ray.shutdown() or a new ray.init()); build a new ReshardGroup")

    def _ray_alive(self) -> bool:
        """Whether the driver is still connected to the Ray instance the group was built on
        (never start or attach to another one by calling into it)."""
        return ray.is_initialized() and membership.session()[0] == self._ray_session

    def _ranks_of(self, pids):
        return self.members.ranks_of(pids)


# After a process failed, how long the others get to report before they count as hung
# (LATE_SETTLE_S once the refit's deadline passed: those still busy then are hung). Members
# reach their own deadlines a little apart and then spend up to LATE_STORE_CHECK_S asking the
# store for an abort (a frozen store host answers nothing): the late window covers that, with
# a second of scheduling slack, so a member blocked on a frozen peer is not named hung itself.
SETTLE_S = 3.0
# How long a refit after a failed one waits for every member to answer before it re-forms
# the group (`ReshardGroup._recover`).
RECOVER_PROBE_S = 2.0
LATE_SETTLE_S = torch_pg.LATE_STORE_CHECK_S + 1.0


def describe_failure(proc: int, e: Exception) -> str:
    """One process's failure, with the cause's own text (several lines kept: NCCL and torch
    put the reason after the first line)."""
    if isinstance(e, ActorUnavailableError):
        return (f"process {proc} is unavailable (Ray is restarting it, or cannot reach it); "
                f"a restarted actor loses its group state: call update()")
    if isinstance(e, RayActorError):
        return f"process {proc} died ({type(e).__name__})"
    cause = e.cause if getattr(e, "cause", None) is not None else e
    lines = [ln for ln in str(cause).splitlines() if ln.strip()][:6]
    text = " | ".join(lines)
    if len(text) > 800:
        text = text[:800] + " ..."
    return f"process {proc}: {type(cause).__name__}: {text}"


def refuse_problems(problems_per_process) -> None:
    problems = [e for errs in problems_per_process for e in errs]
    raise ValueError("refit refused before moving any byte:\n  " + "\n  ".join(problems))


def check_timeout(timeout_s) -> None:
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a positive number of seconds (or None for the "
                         f"default), got {timeout_s!r}")


def default_timeout_s(total_bytes: int) -> float:
    """A refit deadline from its payload: 60 s plus 20 s per GB (a floor of 50 MB/s)."""
    return 60.0 + 20.0 * total_bytes / 1e9
