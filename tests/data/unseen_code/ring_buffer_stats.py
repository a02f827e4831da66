"""Streaming statistics over a fixed window of numeric samples.

The buffer keeps the most recent ``capacity`` samples. Mean and variance are
tracked incrementally with Welford's update, extended with a matching removal
step so that evicted samples leave the running totals in a consistent state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional


@dataclass(frozen=True)
class WindowSummary:
    """Snapshot of the statistics for the samples currently held."""

    count: int
    mean: float
    stdev: float
    minimum: float
    maximum: float
    median: float

    def as_row(self, precision: int = 3) -> str:
        """Return the summary as a single tab separated line."""
        fields = (self.mean, self.stdev, self.minimum, self.maximum,
                  self.median)
        parts = [str(self.count)] + [f"{v:.{precision}f}" for v in fields]
        return "\t".join(parts)


class SampleRing:
    """Fixed-size circular store of floats with running moments."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be a positive integer")
        self._slots: List[float] = [0.0] * capacity
        self._capacity = capacity
        self._head = 0
        self._size = 0
        self._mean = 0.0
        self._m2 = 0.0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[float]:
        """Yield held samples from oldest to newest."""
        start = (self._head - self._size) % self._capacity
        for offset in range(self._size):
            yield self._slots[(start + offset) % self._capacity]

    @property
    def full(self) -> bool:
        return self._size == self._capacity

    def push(self, value: float) -> Optional[float]:
        """Insert ``value`` and return the sample it displaced, if any."""
        value = float(value)
        if math.isnan(value):
            raise ValueError("NaN samples are not accepted")
        evicted: Optional[float] = None
        if self.full:
            evicted = self._slots[self._head]
            self._forget(evicted)
        self._slots[self._head] = value
        self._head = (self._head + 1) % self._capacity
        self._size += 1
        delta = value - self._mean
        self._mean += delta / self._size
        self._m2 += delta * (value - self._mean)
        return evicted

    def extend(self, values: Iterable[float]) -> int:
        """Push every value from ``values``; return how many were added."""
        added = 0
        for item in values:
            self.push(item)
            added += 1
        return added

    def _forget(self, old: float) -> None:
        # Inverse of the Welford step: undo the contribution of ``old``.
        if self._size == 1:
            self._size = 0
            self._mean = 0.0
            self._m2 = 0.0
            return
        shrunk_mean = (self._size * self._mean - old) / (self._size - 1)
        self._m2 -= (old - self._mean) * (old - shrunk_mean)
        self._m2 = max(self._m2, 0.0)
        self._mean = shrunk_mean
        self._size -= 1

    def mean(self) -> float:
        if not self._size:
            raise ValueError("buffer is empty")
        return self._mean

    def variance(self, sample: bool = True) -> float:
        """Population or sample variance of the held window."""
        denom = self._size - 1 if sample else self._size
        if denom <= 0:
            return 0.0
        return self._m2 / denom

    def percentile(self, q: float) -> float:
        """Linear-interpolated percentile, ``q`` given in the range 0..100."""
        if not 0.0 <= q <= 100.0:
            raise ValueError("q must lie between 0 and 100")
        ordered = sorted(self)
        if not ordered:
            raise ValueError("buffer is empty")
        rank = (len(ordered) - 1) * q / 100.0
        lower = math.floor(rank)
        upper = min(lower + 1, len(ordered) - 1)
        weight = rank - lower
        return ordered[lower] * (1.0 - weight) + ordered[upper] * weight

    def summary(self) -> WindowSummary:
        held = list(self)
        if not held:
            raise ValueError("buffer is empty")
        return WindowSummary(
            count=len(held),
            mean=self._mean,
            stdev=math.sqrt(self.variance()),
            minimum=min(held),
            maximum=max(held),
            median=self.percentile(50.0),
        )
