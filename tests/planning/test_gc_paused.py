"""The collector pause around building plans and programs: what it built for keeps goes
straight to the oldest generation; a process's own frozen objects stay frozen."""
import gc

from ray_reshard._gc import gc_paused


class Piece:
    pass


def _generation_of(obj) -> int:
    for g in range(3):
        if any(o is obj for o in gc.get_objects(generation=g)):
            return g
    return -1


def test_kept_objects_go_to_the_oldest_generation_and_the_collector_runs_again():
    gc.collect()
    assert gc.isenabled()
    with gc_paused(keep=True):
        assert not gc.isenabled()
        kept = [Piece() for _ in range(1000)]
    assert gc.isenabled()
    assert _generation_of(kept[0]) == 2 and _generation_of(kept[-1]) == 2
    assert gc.get_freeze_count() == 0


def test_without_keep_objects_stay_young():
    gc.collect()
    with gc_paused():
        young = [Piece() for _ in range(10)]
    assert _generation_of(young[0]) in (0, 1)


def test_a_process_with_frozen_objects_keeps_them_frozen():
    gc.collect()
    theirs = [Piece() for _ in range(10)]
    gc.freeze()
    try:
        with gc_paused(keep=True):
            mine = [Piece() for _ in range(10)]
        # not unfrozen by the pause: theirs still in the permanent generation (its count
        # may drop meanwhile: a frozen object that dies leaves it)
        assert gc.get_freeze_count() >= len(theirs)
        assert _generation_of(theirs[0]) == -1 and _generation_of(theirs[-1]) == -1
        assert _generation_of(mine[0]) in (0, 1)
    finally:
        gc.unfreeze()


def test_a_pause_inside_a_pause_leaves_the_collector_off():
    with gc_paused():
        with gc_paused(keep=True):
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
