"""The cyclic garbage collector's settings for a serving process, applied once it has started.

A serving process allocates short-lived containers on every token (deltas, logprob rows, protobuf
wrappers); reference counting frees nearly all of them, but CPython's collector still runs a young
collection every 700 net container allocations and, every so often, a full one over every tracked
object — the tokenizer's tables, the chat templates, the imported libraries: a pause for every stream
(BENCHMARKS.md, "An engine stream paced by its readers, and a settled heap"). `settle_heap()` moves what
start-up built out of the collector's reach (`gc.freeze`: a full collection then scans only what was
allocated since) and collects the young generation every `GEN0_THRESHOLD` allocations, so a serving
process spends its collector time in proportion to the garbage cycles it makes, which are few, not to
its request rate.

The collector counts objects, not bytes: a cycle that holds one list of two million ids counts as a
handful of objects, and such cycles could pile up to gigabytes before the older generations' thresholds
were reached. So `settle_heap()` also starts a `GarbageWatch`: once a second it reads the process's
resident memory, and when that has grown by more than `HEAP_SLACK_BYTES` since the last full collection
it runs one. Invariant: garbage in cycles never holds more than about `HEAP_SLACK_BYTES` (plus what one
second of requests allocates) for long, whatever the collector's counts; a process whose memory grows
for real pays one full collection per `HEAP_SLACK_BYTES` of growth. The code keeps cycles rare (a
request's failure never forms one with its data); the watch is what bounds the ones that remain.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable

GEN0_THRESHOLD = 50_000  # net container allocations between two young collections (CPython's default: 700)
HEAP_SLACK_BYTES = 256 * 2**20  # resident growth since the last full collection that triggers another
WATCH_INTERVAL_S = 1.0

_watch: GarbageWatch | None = None


def settle_heap() -> None:
    """Collect and freeze everything allocated so far, then space young collections `GEN0_THRESHOLD`
    apart (the older generations keep their default ratios) and start the process's `GarbageWatch`.
    Call once, after start-up."""
    global _watch
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    if _watch is None and resident_bytes() is not None:
        _watch = GarbageWatch()
        _watch.start()


def stop_garbage_watch() -> None:
    """Stop the watch `settle_heap` started (tests; a serving process keeps it until it exits)."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None


def resident_bytes() -> int | None:
    """This process's resident memory (Linux: /proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class GarbageWatch:
    """A full collection whenever resident memory grew by more than `slack_bytes` since the last one."""

    def __init__(self, slack_bytes: int = HEAP_SLACK_BYTES, interval_s: float = WATCH_INTERVAL_S,
                 resident: Callable[[], int | None] = resident_bytes) -> None:
        self.slack_bytes = slack_bytes
        self.interval_s = interval_s
        self.collections = 0  # full collections this watch ran
        self._resident = resident
        self._baseline = resident() or 0  # resident memory after the last full collection
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """One look: collect (and move the baseline to what is resident after it) when over the slack."""
        now = self._resident()
        if now is None:
            return False
        if now - self._baseline <= self.slack_bytes:
            self._baseline = min(self._baseline, now)  # memory given back lowers the mark growth counts from
            return False
        gc.collect()
        self.collections += 1
        self._baseline = self._resident() or now
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="garbage-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()
