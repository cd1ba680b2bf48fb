"""Wall-clock time per call, as the benchmark scripts measure it where no device timer applies (the CPU).

It lives in the package, not beside the scripts: `benchmarks/` is not on the path of the tests that load the
scripts by file (a top-level module there, `kernels`, would pass for Hugging Face's `kernels` package).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_wall_us(fn: Callable[[], object], iters: int) -> float:
    """Median microseconds of wall time per call of ``fn`` over ``iters`` calls, after one untimed call (the
    first call pays for compiles, caches and lazy imports). Host time: on CUDA it says nothing of the device."""
    fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)
