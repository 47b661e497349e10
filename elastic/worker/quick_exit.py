"""A worker's interpreter exit that neither walks nor frees torch's objects one by one.

Python's exit runs the cyclic garbage collector over every object it tracks and frees,
one by one, the cycles it finds once the modules are cleared: with torch imported,
most of its 170,000 objects. A worker's exit took 1.42 s here against 0.52 s with the
heap frozen (``benchmarks/exit_cost.py``, median of 5). That is CPU taken from
the job at every resize, and a leaving node's saved workers get only ``EXIT_GRACE``
(0.5 s) to end before they are killed.

So, at exit, once the script's own ``atexit`` handlers (those registered after its
``State``) have run: one collection, which still finalizes what is already garbage (an
object in a reference cycle has its ``__del__`` run, as before; frozen unseen, it never
would), then ``gc.freeze()``. What is still reachable then is torn down by reference
counts as before; cycles among it are left to the operating system, which Python
allows (``__del__`` is not promised for objects that still exist at exit).
"""

from __future__ import annotations

import atexit
import gc

_armed = False


def arm() -> None:
    """Freeze the heap at exit (once per process, whatever the number of States)."""
    global _armed
    if not _armed:
        atexit.register(_freeze)
        _armed = True


def _freeze() -> None:
    gc.collect()
    gc.freeze()
