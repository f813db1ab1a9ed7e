"""Counters and phase timers of one engine."""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator


class Stats:
    """Byte counters per link and seconds per phase. Only ever written to by the engine and
    read by ``Engine.stats()``: no decision is taken on these numbers."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = defaultdict(int)
        self.seconds: Dict[str, float] = defaultdict(float)
        self.counts: Dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()  # the copy and optimizer workers count too

    def add_bytes(self, link: str, num_bytes: int) -> None:
        with self._lock:
            self.bytes[link] += num_bytes

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self.seconds[phase] += elapsed
