"""The engine's periodic stats line (vLLM's `LoggingStatLogger` and `SpecDecodingLogging`).

Every `interval` seconds, when the engine did anything since the last line, one INFO line:
    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.3 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%
and with speculative decoding, when drafts were verified in the interval:
    SpecDecoding metrics: Mean acceptance length: 2.31, Accepted throughput: 40.10 tokens/s, Drafted
    throughput: 120.00 tokens/s, Accepted: 401 tokens, Drafted: 1200 tokens, Per-position acceptance
    rate: 0.612, 0.401, 0.298, Avg Draft acceptance rate: 33.4%
(throughputs and rates over the interval; usage and counts as of the last step). `--disable-log-stats`
turns it off (vLLM's flag), `--log-stats-interval` sets the period.

Invariants: `record_step` runs on the busy-loop thread and only adds two integers and keeps a
reference; the line is built and logged on this logger's own thread, never on the step loop. An idle
engine (no token computed, nothing running or waiting) logs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from shared_runtime.contract import SchedulerStats

logger = logging.getLogger("engine_svc.stats")

DEFAULT_INTERVAL_S = 10.0


class StatLogger:
    """Accumulates per-step token counts and logs the stats line every `interval_s` (see the module)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"--log-stats-interval must be > 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._prompt_tokens = 0  # cumulative (busy-loop thread writes, logger thread reads)
        self._generation_tokens = 0
        self._latest: SchedulerStats | None = None
        self._last_time = clock()
        self._last_prompt = self._last_generation = 0
        self._last: SchedulerStats = SchedulerStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record_step(self, stats: SchedulerStats | None) -> None:
        """One step's figures (busy-loop thread)."""
        if stats is not None:
            self._prompt_tokens += stats.num_prompt_tokens
            self._generation_tokens += stats.num_generation_tokens
            self._latest = stats

    def lines(self) -> list[str]:
        """The lines for the interval since the last call (none when the engine was idle), and a new interval."""
        now, stats = self._clock(), self._latest
        prompt, generation = self._prompt_tokens, self._generation_tokens
        elapsed = max(now - self._last_time, 1e-9)
        d_prompt, d_generation = prompt - self._last_prompt, generation - self._last_generation
        last = self._last
        self._last_time, self._last_prompt, self._last_generation = now, prompt, generation
        if stats is None:
            return []
        self._last = stats
        if not d_prompt and not d_generation and not stats.num_running and not stats.num_waiting:
            return []
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        out = [f"Avg prompt throughput: {d_prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
               f"{d_generation / elapsed:.1f} tokens/s, Running: {stats.num_running} reqs, Waiting: "
               f"{stats.num_waiting} reqs, KV cache usage: {100 * stats.kv_cache_usage:.1f}%, Prefix cache hit "
               f"rate: {100 * hits / queries if queries else 0.0:.1f}%"]
        drafts = stats.spec_decode_num_drafts - last.spec_decode_num_drafts
        if drafts > 0:
            drafted = stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
            accepted = stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
            before = last.spec_decode_num_accepted_tokens_per_pos
            per_pos = [(n - (before[i] if i < len(before) else 0)) / drafts
                       for i, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)]
            out.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted "
                       f"throughput: {accepted / elapsed:.2f} tokens/s, Drafted throughput: {drafted / elapsed:.2f} "
                       f"tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance "
                       f"rate: {', '.join(f'{r:.3f}' for r in per_pos)}, Avg Draft acceptance rate: "
                       f"{100 * accepted / drafted if drafted else 0.0:.1f}%")
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stat-logger", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for line in self.lines():
                logger.info("%s", line)
