"""A long-running command freezes what its start-up made (`forerun serve`, `forerun run`): garbage is collected
first (none is kept for ever), and what is left is out of every later collection's walk."""

from __future__ import annotations

import gc
import weakref

from forerun.cli.common import freeze_start_up


class Cyclic:
    """An object that refers to itself: only a collection frees it."""

    def __init__(self) -> None:
        self.itself = self


def test_start_up_garbage_is_collected_and_the_rest_frozen():
    garbage, kept = Cyclic(), Cyclic()
    gone = weakref.ref(garbage)
    del garbage
    assert gc.get_freeze_count() == 0
    freeze_start_up()
    assert gone() is None  # collected before the freeze, not kept for ever
    assert gc.get_freeze_count() > 0 and not gc.is_finalized(kept)
    assert not any(obj is kept for obj in gc.get_objects())  # frozen: no collection walks it
