"""Exceptions raised by ray-reshard."""
from __future__ import annotations


class RefitError(RuntimeError):
    """A refit failed; `failed_ranks` names the ranks at fault as (side, rank) pairs."""

    def __init__(self, message: str, failed_ranks=()):
        super().__init__(message)
        self.failed_ranks = tuple(failed_ranks)


class TransportError(RuntimeError):
    """A transfer between two ranks failed (peer gone, channel aborted)."""


class TransportTimeout(TransportError, TimeoutError):
    """A transfer did not complete before its deadline."""


class GroupStateLost(RuntimeError):
    """An actor has no state for a group it belongs to (it restarted, or left the group)."""
