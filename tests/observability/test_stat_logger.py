"""The engine's periodic stats line (engine_svc/telemetry/stat_logger.py): vLLM's fields, figures over the
interval, nothing while idle, the speculative line only when drafts were verified. (The line from a
running `tandem-engine`: test_otlp_e2e.py.)"""

from __future__ import annotations

import logging

import pytest

from engine_svc.api.server import _step_hooks
from engine_svc.cli import main
from engine_svc.telemetry.stat_logger import StatLogger
from shared_runtime.contract import SchedulerStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(prompt: int, generation: int, **stats: object) -> SchedulerStats:
    return SchedulerStats(num_prompt_tokens=prompt, num_generation_tokens=generation,
                          num_scheduled_tokens=prompt + generation, **stats)  # type: ignore[arg-type]


def test_the_line_reports_the_interval() -> None:
    clock = Clock()
    stat = StatLogger(2.0, clock)
    assert stat.lines() == []  # nothing ran yet
    stat.record_step(step(60, 0, num_running=1, prefix_cache_queries=100, prefix_cache_hits=40))
    stat.record_step(step(40, 20, num_running=2, num_waiting=3, kv_cache_usage=0.25,
                          prefix_cache_queries=100, prefix_cache_hits=40))
    clock.now += 2.0
    assert stat.lines() == ["Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                            "Running: 2 reqs, Waiting: 3 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"]
    stat.record_step(step(0, 8, num_running=2, prefix_cache_queries=300, prefix_cache_hits=40))
    clock.now += 4.0
    line = stat.lines()[0]
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0 tokens/s" in line
    assert "Prefix cache hit rate: 0.0%" in line  # 200 queries, no hit, in this interval
    stat.record_step(step(0, 0))
    clock.now += 2.0
    assert stat.lines() == []  # idle: no line


def test_the_speculative_line_counts_the_interval_drafts() -> None:
    clock = Clock()
    stat = StatLogger(1.0, clock)
    stat.record_step(step(0, 10, num_running=1, spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
                          spec_decode_num_accepted_tokens=12, spec_decode_num_accepted_tokens_per_pos=[8, 3, 1]))
    clock.now += 1.0
    stat.lines()
    stat.record_step(step(0, 25, num_running=1, spec_decode_num_drafts=20, spec_decode_num_draft_tokens=60,
                          spec_decode_num_accepted_tokens=27, spec_decode_num_accepted_tokens_per_pos=[16, 8, 3]))
    clock.now += 2.0
    lines = stat.lines()
    assert lines[1] == ("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 7.50 tokens/s, "
                        "Drafted throughput: 15.00 tokens/s, Accepted: 15 tokens, Drafted: 30 tokens, Per-position "
                        "acceptance rate: 0.800, 0.500, 0.200, Avg Draft acceptance rate: 50.0%")
    stat.record_step(step(0, 5, num_running=1, spec_decode_num_drafts=20, spec_decode_num_draft_tokens=60,
                          spec_decode_num_accepted_tokens=27, spec_decode_num_accepted_tokens_per_pos=[16, 8, 3]))
    clock.now += 1.0
    assert len(stat.lines()) == 1  # no verification in this interval: no speculative line


def test_the_thread_logs_and_the_step_hook_feeds_both(caplog: pytest.LogCaptureFixture) -> None:
    class Counting:
        def __init__(self) -> None:
            self.steps = 0

        def record_step(self, stats: SchedulerStats | None) -> None:
            self.steps += 1

    stat = StatLogger(0.05)
    metrics = Counting()
    hook = _step_hooks(metrics, stat)  # type: ignore[arg-type]
    assert hook is not None and _step_hooks(None, None) is None
    with caplog.at_level(logging.INFO, logger="engine_svc.stats"):
        stat.start()
        try:
            hook(step(10, 1, num_running=1))
            for _ in range(100):
                if caplog.records:
                    break
                stat._stop.wait(0.05)
        finally:
            stat.stop()
    assert metrics.steps == 1
    assert any("Avg prompt throughput" in r.getMessage() and "Running: 1 reqs" in r.getMessage()
               for r in caplog.records)


def test_a_bad_interval_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "unused", "--log-stats-interval", "0"]) == 2
    assert "--log-stats-interval must be > 0 seconds, got 0.0" in capsys.readouterr().err
