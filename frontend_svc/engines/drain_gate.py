"""`DrainGate`: an engine stream paced by the readers of its output.

As Nagle's algorithm paces a socket by its acknowledgements: after processing a batch of engine messages
the connection (engine_client.py) waits until the readers it handed output to have taken it and sent it
(at most `DRAIN_WAIT_S`) before it takes the next batch. While the frontend keeps up, the readers are done
long before the engine's next step arrives and nothing waits; once it falls behind, the steps that queue
meanwhile are processed together, so each stream gets one response per several steps instead of one per
step, and the per-response cost is spread over more tokens (BENCHMARKS.md, "the engine stream paced by
its readers"). A reader that does not drain (a stalled client) holds back one batch by at most
`DRAIN_WAIT_S`, once: the gate counts only the readers handed output since its previous batch.

A reader's side of the gate is its `DeltaCollector` (delta_collector.py). Everything here runs on one
asyncio loop.
"""

from __future__ import annotations

import asyncio

DRAIN_WAIT_S = 0.005  # the longest an engine batch waits for the previous batch's readers


class DrainGate:
    """One engine stream's pacing by its readers (see the module docstring).

    Invariant: `_outstanding` counts the collectors handed output in the current epoch that have not
    yet come back for more; an epoch ends at each `drained()`, and a collector handed output in an earlier
    epoch no longer counts (its `taken` is ignored)."""

    __slots__ = ("_drained", "_epoch", "_outstanding")

    def __init__(self) -> None:
        self._epoch = 0
        self._outstanding = 0
        self._drained = asyncio.Event()

    @property
    def outstanding(self) -> int:
        """Readers handed output in this epoch that have not come back for more."""
        return self._outstanding

    def handed(self) -> int:
        """A collector with no unread output got some: the epoch to hand back to `taken`."""
        self._outstanding += 1
        return self._epoch

    def taken(self, epoch: int) -> None:
        """The reader of a collector handed output in `epoch` has taken and sent it."""
        if epoch == self._epoch:
            self._outstanding -= 1
            if not self._outstanding:
                self._drained.set()

    async def drained(self, timeout: float = DRAIN_WAIT_S) -> None:
        """Wait until the readers handed output in this epoch have taken it (at most `timeout`), then
        begin the next epoch."""
        if self._outstanding:
            self._drained.clear()
            expiry = asyncio.get_running_loop().call_later(timeout, self._drained.set)
            await self._drained.wait()
            expiry.cancel()
        self._epoch += 1
        self._outstanding = 0
