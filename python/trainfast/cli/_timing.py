"""Timing for the demos' side-by-side comparisons."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


def best_of(fn: Callable[[], _T], repeats: int = 5) -> tuple[_T, float]:
    """``fn()``'s result and its fastest time in seconds over ``repeats`` calls (at least one)."""
    start = time.perf_counter()
    result = fn()
    best = time.perf_counter() - start
    for _ in range(repeats - 1):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best
