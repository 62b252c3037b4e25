"""Serving from vLLM engines that refits update: generation never overlaps an update session,
and every output says which weight version produced it.

A refit of a live engine is one update session of vLLM's weight-transfer API
(``start_weight_update``, the bytes, ``update_weights``, ``finish_weight_update``), several calls
on the engine actor. A generation call arriving between two of them would run on weights being
replaced. The gate kept here, inside each engine actor (functions shipped through
``__ray_call__``; nothing to install in the engine), closes generation for the session:

    client = GatedClient(engines, owner=trainer_actor, participants=trainer_actors)
    # hand `client` to the vLLM backend (RayReshardTrainerEngine.trainer_init(..., client=client))
    out = generate(engine, [[1, 2, 3]], max_tokens=8)     # waits while a session is open
    out[0]["version"]                                     # the weights it was generated with

An engine is *serving* (a version: the label of the last refit that completed, None for the
weights it started with), *updating* (a session is open: callers wait), or *held* (its weights
may mix two versions: callers wait for the next refit that completes). A session whose driver
died or overran its lease is closed by the engine itself, at the next call that finds it.
"""
from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ...errors import RefitError
from .launch import generate_in_engine

__all__ = ["GatedClient", "call", "generate", "status"]

SERVING, UPDATING, HELD = "serving", "updating", "held"
# How often a caller waiting on an open session asks again, and how often the engine then
# checks that the session's driver is alive.
POLL_S = (0.01, 0.1)
PROBE_EVERY_S = 0.5


# ------------------------------------------------------------------ engine side (in the actor)
@dataclass
class Gate:
    """One engine's state (kept in the engine actor's process)."""

    state: str = SERVING
    version: Optional[int] = None       # label of the weights served (None: as started)
    held_why: Optional[str] = None
    last_failure: Optional[str] = None
    refits: int = 0                     # sessions that completed
    # the open session
    session: Optional[str] = None
    label: Optional[int] = None
    owner: Any = None                   # the trainer actor that drives it
    participants: list = field(default_factory=list)
    deadline: float = 0.0
    atomic: bool = True
    loaded: bool = False
    load_failed: Optional[str] = None
    probe: Any = None
    probe_at: float = 0.0

    def public(self) -> dict:
        return {"state": self.state, "version": self.version, "held_why": self.held_why,
                "updating_to": self.label if self.state == UPDATING else None,
                "last_failure": self.last_failure, "refits": self.refits}


_GATES: dict[int, Gate] = {}


def gate_of(llm) -> Gate:
    return _GATES.setdefault(id(llm), Gate())


def _alive(actor) -> bool:
    return True


def _orphaned(g: Gate) -> Optional[str]:
    """Why the open session can no longer finish (its driver is gone, or its lease ran out);
    None while it may."""
    if time.monotonic() > g.deadline:
        return "its driver did not finish it within its lease"
    now = time.monotonic()
    if g.probe is None:
        if now - g.probe_at >= PROBE_EVERY_S:
            g.probe, g.probe_at = g.owner.__ray_call__.remote(_alive), now
        return None
    ready, _ = ray.wait([g.probe], timeout=0)
    if not ready:
        return None                     # alive and busy (it is driving the refit)
    probe, g.probe = g.probe, None
    try:
        ray.get(probe)
    except RayActorError:
        return "its driver (trainer rank 0) is gone"
    return None


def _gone(actors: Sequence[Any], wait_s: float = 2.0) -> list[int]:
    """Indices of `actors` that are dead (a call fails at once); live busy ones are not."""
    refs = [a.__ray_call__.remote(_alive) for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    dead = []
    for i, r in enumerate(refs):
        if r in ready:
            try:
                ray.get(r)
            except RayActorError:
                dead.append(i)
    return dead


def _close_orphan(llm, g: Gate, why: str) -> None:
    """Close a session its driver cannot finish: restore what the session took apart (vLLM's
    finish), then serve the new version if it had loaded, the old one if the refit was atomic
    (nothing written in place before its last phase), else hold."""
    dead = _gone(g.participants)
    gone = f"; trainer rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} " \
           f"{'are' if len(dead) > 1 else 'is'} gone" if dead else ""
    what = f"RefitError: refit v{g.label} did not complete: {why}{gone}"
    try:
        llm.finish_weight_update()
    except Exception as e:      # noqa: BLE001  (recorded; the engine is held below)
        g.load_failed = g.load_failed or f"vLLM's finish_weight_update failed: {e}"
    if g.loaded and not g.load_failed:
        llm.update_weight_version(str(g.label))
        _serve(g, g.label)
        g.last_failure = f"{what} (its weights had loaded: the engine finished the session)"
    elif g.atomic and not g.load_failed:
        _serve(g, g.version)
        g.last_failure = f"{what}; serving v{g.version} (atomic: nothing of v{g.label} was " \
                         f"written in place)"
    else:
        _hold(g, f"{what}{'; ' + g.load_failed if g.load_failed else ''}: the engine may "
                 f"hold parts of two versions until a refit completes")
        g.last_failure = g.held_why


def _serve(g: Gate, version: Optional[int]) -> None:
    g.state, g.version, g.held_why = SERVING, version, None
    g.session, g.owner, g.participants, g.probe = None, None, [], None


def _hold(g: Gate, why: str) -> None:
    g.state, g.held_why = HELD, why
    g.session, g.owner, g.participants, g.probe = None, None, [], None


def gate_start(llm, session: str, label: int, owner, participants: list, lease_s: float,
               atomic: bool) -> dict:
    """Open an update session (vLLM's start_weight_update): generation waits from now on."""
    g = gate_of(llm)
    if g.state == UPDATING:
        why = _orphaned(g)
        if why is None and g.owner is not None:
            dead = _gone([g.owner], wait_s=1.0)
            why = "its driver (trainer rank 0) is gone" if dead else None
        if why is None:
            raise RuntimeError(f"the engine is in the update session of refit v{g.label}, which "
                               f"another trainer group drives; one group refits an engine at "
                               f"a time")
        _close_orphan(llm, g, why)
    llm.start_weight_update()
    g.state, g.session, g.label, g.owner = UPDATING, session, label, owner
    g.participants, g.deadline, g.atomic = list(participants), time.monotonic() + lease_s, atomic
    g.loaded, g.load_failed, g.probe, g.probe_at = False, None, None, time.monotonic()
    return g.public()


def _check_session(g: Gate, session: str, what: str) -> None:
    if g.session != session:
        raise RuntimeError(f"{what}: the engine closed this update session already "
                           f"({g.last_failure or 'it was replaced'})")


def gate_update(llm, session: str, update_info: dict) -> None:
    """vLLM's update_weights inside the session (the fallback pieces load here)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    g = gate_of(llm)
    _check_session(g, session, "update_weights")
    try:
        llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
    except BaseException as e:
        g.load_failed = f"update_weights failed part-way ({type(e).__name__}: {e})"
        raise
    g.loaded = True


def gate_finish(llm, session: str, failure: Optional[str]) -> dict:
    """Close the session: serve its version when it loaded; else the previous one (atomic
    refits) or hold (the engine may mix versions). `failure`: why, when it did not load."""
    g = gate_of(llm)
    if g.session != session:        # closed by the engine already (its lease ran out)
        return g.public()
    ok = g.loaded and not g.load_failed
    try:
        if ok:
            llm.finish_weight_update(str(g.label))
        else:
            llm.finish_weight_update()
    except BaseException as e:
        _hold(g, f"vLLM's finish_weight_update failed for refit v{g.label} "
                 f"({type(e).__name__}: {e})")
        g.last_failure = g.held_why
        raise
    if ok:
        g.refits += 1
        _serve(g, g.label)
        return g.public()
    label = g.label
    why = failure or "the session closed before its weights loaded"
    if g.atomic and not g.load_failed:
        g.last_failure = f"refit v{label} failed ({why}); serving v{g.version} (atomic: " \
                         f"nothing of v{label} was written in place)"
        _serve(g, g.version)
    else:
        _hold(g, f"refit v{label} failed part-way ({g.load_failed or why}): the engine may "
                 f"hold parts of two versions until a refit completes")
        g.last_failure = g.held_why
    return g.public()


def gate_status(llm) -> dict:
    g = gate_of(llm)
    if g.state == UPDATING:
        why = _orphaned(g)
        if why is not None:
            _close_orphan(llm, g, why)
    return g.public()


def gate_call(llm, fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """Run ``fn(llm, *args, **kwargs)`` unless a session is open or the engine is held:
    ("ok", version, result), ("wait", status)."""
    g = gate_of(llm)
    if g.state == UPDATING:
        why = _orphaned(g)
        if why is None:
            return "wait", g.public()
        _close_orphan(llm, g, why)
    if g.state == HELD:
        return "wait", g.public()
    return "ok", g.version, fn(llm, *args, **kwargs)


# -------------------------------------------------------------------------- callers' side
def status(engine, timeout_s: float = 60.0) -> dict:
    """The engine's gate: state ("serving", "updating", "held"), version served, why held,
    the last refit failure, refits completed."""
    return ray.get(engine.__ray_call__.remote(gate_status), timeout=timeout_s)


def call(engine, fn: Callable, *args, timeout_s: float = 300.0, **kwargs) -> tuple:
    """``fn(llm, *args, **kwargs)`` in the engine actor, never during an update session nor
    while the engine is held; returns (version, result). Waits up to `timeout_s` for the
    engine to serve (TimeoutError naming its state otherwise)."""
    deadline = time.monotonic() + timeout_s
    pause = POLL_S[0]
    st = None                     # the gate's state at the last answer that was not "ok"

    def not_served():
        return TimeoutError(f"the engine did not serve within {timeout_s} s: it is "
                            f"{st['state']}" + (f" ({st['held_why']})" if st["held_why"]
                                                else f" (refit v{st['updating_to']})"))
    while True:
        left = deadline - time.monotonic()
        try:
            out = ray.get(engine.__ray_call__.remote(gate_call, fn, args, kwargs),
                          timeout=max(left, 0.001))
        except GetTimeoutError:
            if st is not None:    # it answered before: a late poll outlived the deadline
                raise not_served() from None
            raise TimeoutError(f"the engine did not answer within {timeout_s} s") from None
        if out[0] == "ok":
            return out[1], out[2]
        st = out[1]
        if time.monotonic() + pause > deadline:
            raise not_served()
        time.sleep(pause)
        pause = min(pause * 2, POLL_S[1])


def generate(engine, prompts: Sequence[Sequence[int]], max_tokens: int = 16, *,
             temperature: float = 0.0, seed: Optional[int] = None,
             timeout_s: float = 300.0) -> list[dict]:
    """Generation from token-id prompts (greedy by default), outside update sessions: per
    prompt the new token ids, each one's logprob, and ``version`` (the refit label of the
    weights that produced all of them; None: the weights the engine started with). Also
    vLLM's own ``weight_versions`` spans."""
    version, outs = call(engine, generate_in_engine, [list(p) for p in prompts], max_tokens,
                         temperature, seed, True, timeout_s=timeout_s)
    for o in outs:
        o["version"] = version
    return outs


class GatedClient:
    """vLLM's weight-sync client protocol (``init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update``) over engine actors,
    through each engine's gate. `label` names the next session's weights (set it before each
    refit); `owner` is the actor that drives sessions (its death closes them), `participants`
    the trainer actors (named when a session is abandoned); `lease_s` bounds a session and every
    call into an engine."""

    def __init__(self, engines: Sequence[Any], *, owner: Any, participants: Sequence[Any] = (),
                 lease_s: float = 300.0, atomic: bool = True):
        self.handles = list(engines)
        self.owner, self.participants = owner, list(participants)
        self.lease_s, self.atomic = float(lease_s), atomic
        self.label: Optional[int] = None
        self.session: Optional[str] = None

    def _all(self, what: str, refs: list) -> list:
        out, errors = [], []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.lease_s)
        for i, r in enumerate(refs):
            if r not in ready:
                errors.append((i, f"did not answer {what} within {self.lease_s} s"))
                out.append(None)
                continue
            try:
                out.append(ray.get(r))
            except Exception as e:      # noqa: BLE001  (named per engine below)
                cause = getattr(e, "cause", None) or e
                errors.append((i, f"{what} failed: {type(cause).__name__}: {cause}"))
                out.append(None)
        if errors:
            raise RefitError("; ".join(f"engine {i} {m}" for i, m in errors),
                             [("dst", i) for i, _ in errors])
        return out

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        req = WeightTransferInitRequest(init_info=init_info)
        self._all("init_weight_transfer_engine",
                  [h.init_weight_transfer_engine.remote(req) for h in self.handles])

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("shutdown_weight_transfer_engine",
                  [h.shutdown_weight_transfer_engine.remote() for h in self.handles])

    def start_weight_update(self) -> None:
        if self.label is None:
            raise ValueError("GatedClient.label: the version of the weights to send")
        self.session = uuid.uuid4().hex
        refs = [h.__ray_call__.remote(gate_start, self.session, self.label, self.owner,
                                      self.participants, self.lease_s, self.atomic)
                for h in self.handles]
        try:
            self._all("start_weight_update", refs)
        except RefitError:      # close the sessions that did open
            self._close_quietly(refs, "another engine could not start the session")
            raise

    def _close_quietly(self, refs: list, why: str) -> None:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.lease_s)
        opened = []
        for h, r in zip(self.handles, refs):
            try:
                if r in ready:
                    ray.get(r)
                    opened.append(h)
            except Exception:       # noqa: BLE001  (that one did not open)
                pass
        ray.wait([h.__ray_call__.remote(gate_finish, self.session, why) for h in opened],
                 num_returns=len(opened), timeout=self.lease_s)

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weights", [h.__ray_call__.remote(gate_update, self.session,
                                                           update_info)
                                     for h in self.handles])

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        # After a failed refit the backend closes the session from inside its `except`: the
        # error being handled is why (the engine uses it only for a session that did not load).
        exc = sys.exc_info()[1]
        failure = None if exc is None else f"{type(exc).__name__}: {exc}"
        self._all("finish_weight_update", [h.__ray_call__.remote(gate_finish, self.session,
                                                                 failure)
                                           for h in self.handles])
