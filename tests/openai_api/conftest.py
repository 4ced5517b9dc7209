"""Fixtures for the OpenAI HTTP API tests: the tiny model, an event loop thread, and an in-process stack
(fake engine + real `FrontendServer` with its HTTP port, tests/security/secure_stack.py) on real sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx2

from tests.security.secure_stack import Stack
from tests.support import LoopThread, free_port, max_gap, wait_until

T = TypeVar("T")


class HttpStack(Stack):
    """A `Stack` whose frontend also serves the OpenAI API; `url` is its base URL."""

    def __init__(self, loop: LoopThread, tokenizer: Any, model_dir: Path, **overrides: Any) -> None:
        super().__init__(loop, tokenizer, model_dir, http_port=free_port(), **overrides)
        self.url = f"http://127.0.0.1:{self.frontend.http.bound_port}"

    def wait_http_ready(self, timeout: float = 15.0) -> None:
        wait_until(lambda: httpx2.get(f"{self.url}/health", timeout=2).status_code == 200, timeout,
                   "/health 200", retry_on=(httpx2.HTTPError,))

    def wait_engine_idle(self, timeout: float = 15.0) -> None:
        """Until the fake engine runs nothing and every admission slot is back."""
        wait_until(lambda: not self.fake.running and self.frontend.admission.in_use == 0, timeout,
                   "engine idle and admission released")


class SseReader:
    """A streaming request read on its own thread: `arrivals` are the monotonic times of its SSE events."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self.arrivals: list[float] = []
        self.events: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body, headers or {}), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            with httpx2.stream("POST", url, json=body, headers=headers, timeout=60) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.arrivals.append(time.monotonic())
                        self.events.append(line[6:])
                    if self._stop.is_set():
                        return
        except BaseException as exc:
            self.error = exc

    def wait_started(self, count: int = 5, timeout: float = 15.0) -> None:
        wait_until(lambda: len(self.arrivals) >= count or self.error is not None, timeout, "stream started")
        assert self.error is None, self.error

    def max_gap(self, start: float, end: float) -> float:
        return max_gap(self.arrivals, start, end)

    def during(self, label: str, action: Callable[[], T]) -> tuple[T, float]:
        """`action`'s result and this stream's longest gap while it ran (printed with `label`); waits 50 ms
        after it so a token held back by it has the time to arrive and count."""
        start = time.monotonic()
        result = action()
        end = time.monotonic()
        time.sleep(0.05)
        gap = self.max_gap(start, end)
        print(f"[stall] {label}: victim max gap {1000 * gap:.1f} ms over {end - start:.2f} s")
        return result, gap

    def stop(self) -> None:
        """Close the connection (the client going away) and wait for the reader thread."""
        self._stop.set()
        self._thread.join(15)
        assert not self._thread.is_alive()
