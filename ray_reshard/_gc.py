"""`gc_paused`: build many acyclic objects (plans, programs, spec sets) without the cyclic
garbage collector rescanning them."""
from __future__ import annotations

import gc
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused(keep: bool = False):
    """Pause the cyclic garbage collector: building or pickling a plan allocates hundreds of
    thousands of acyclic objects, which collections would rescan again and again.

    With `keep` (what was built is long-lived: a plan, a compiled program), the objects still
    alive at the end go straight to the collector's oldest generation instead of being scanned
    by the young generations' next passes first (not while the process has frozen objects of
    its own: `gc.freeze` is then the owner's).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if keep and gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
