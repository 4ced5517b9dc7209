"""The signals of a tandem service process, wired the same way in every service.

- SIGTERM / SIGINT: the first starts a graceful drain (`drain`); any later one stops at once (`stop`),
  and the process then exits non-zero (`exit_code` is 1): a drain cut short is not a clean exit.
- SIGHUP: re-read credentials (`reload`: TLS certificates, API key and token files); the process goes on.

The handlers run on the asyncio loop (`loop.add_signal_handler`), so they may touch the servers' state
directly; a handler that returns an awaitable (e.g. `FrontendServer.drain`) runs as a task of that loop.

Start-up is covered from the first moment: a service installs `ServiceSignals` as the first thing its loop
does and binds the handlers once its server can take them (`bind`); a shutdown signal that came before is
delivered at `bind` (or, if `stopping` is already true, the service does not start at all). Before the
loop runs (imports, argument parsing), `run_main` turns Ctrl-C into a one-line message and exit code 130
instead of a traceback. So no signal, at any moment, ends a service with a traceback.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import sys
from collections.abc import Callable

Handler = Callable[[], object]
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD_SIGNAL = signal.SIGHUP


class ServiceSignals:
    """Install with `install()` inside the running loop; `remove()` (or closing the loop) undoes it.

    Handlers given to the constructor, or later to `bind`, run for each signal; signals before `bind`
    are counted and the first shutdown among them is delivered by `bind`."""

    def __init__(self, *, drain: Handler | None = None, stop: Handler | None = None,
                 reload: Handler | None = None) -> None:
        self._drain, self._stop, self._reload = drain, stop, reload
        self.num_shutdown_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Future[object]] = set()  # keeps handler tasks alive until they end

    @property
    def exit_code(self) -> int:
        """1 once a second shutdown signal cut the drain short, else 0."""
        return 1 if self.num_shutdown_signals > 1 else 0

    @property
    def stopping(self) -> bool:
        """A shutdown signal came (before the handlers were bound, it is still to be acted on)."""
        return self.num_shutdown_signals > 0

    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        for sig in SHUTDOWN_SIGNALS:
            self._loop.add_signal_handler(sig, self.on_shutdown_signal)
        self._loop.add_signal_handler(RELOAD_SIGNAL, self.on_reload_signal)

    def bind(self, *, drain: Handler, stop: Handler, reload: Handler) -> None:
        """The service can take signals now: later ones call these; a shutdown that came before is
        delivered now (a drain, or a stop if there were several)."""
        self._drain, self._stop, self._reload = drain, stop, reload
        if self.num_shutdown_signals:
            self._call(self._drain if self.num_shutdown_signals == 1 else self._stop)

    def remove(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for sig in (*SHUTDOWN_SIGNALS, RELOAD_SIGNAL):
                self._loop.remove_signal_handler(sig)
        self._loop = None

    def on_shutdown_signal(self) -> None:
        self.num_shutdown_signals += 1
        self._call(self._drain if self.num_shutdown_signals == 1 else self._stop)

    def on_reload_signal(self) -> None:
        self._call(self._reload)

    def _call(self, handler: Handler | None) -> None:
        if handler is None:  # not bound yet: `bind` acts on what was counted
            return
        result = handler()
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def run_main(prog: str, main: Callable[[], int]) -> int:
    """`main()`, with a Ctrl-C before the service's loop takes signals (imports, start-up work outside the
    loop) ending it with one line on stderr and exit code 130, not a traceback."""
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
