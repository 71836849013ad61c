"""How fast a call runs, as the demo, the bag-of-words baseline and the benches report it: items a second over the
median of a few timed calls, after one untimed warm-up call (which pays for lazy set-up: a first allocation, a
kernel choice, a cache filled).

    from bertforge.timing import items_per_second
    items_per_second(lambda: predictor.predict(records), len(records), warm_up=lambda: predictor.predict(records[:256]))
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

REPEATS = 3
# A floor on the median call's seconds, so a call quicker than the clock's tick reads as very fast, not as a division
# by zero.
MIN_SECONDS = 1e-9


def items_per_second(run: Callable[[], Any], items: int, warm_up: Callable[[], Any] | None = None,
                     repeats: int = REPEATS) -> float:
    """`items` over the median seconds of `repeats` timed calls of `run`, after one untimed call of `warm_up`
    (default: `run` itself)."""
    (warm_up or run)()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return items / max(statistics.median(seconds), MIN_SECONDS)
