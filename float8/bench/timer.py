"""The millisecond timer the small benches share: do_bench's median on the GPU, a wall clock on the CPU
(where the CPU runs are smoke tests of the plumbing, not measurements)."""

from __future__ import annotations

import time
from typing import Callable


def make_timer(cuda: bool, warmup: int = 25, rep: int = 100) -> Callable[[Callable], float]:
    if cuda:
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

    def wall(fn) -> float:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return wall
