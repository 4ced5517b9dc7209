"""`WatchLoraAdapters`: the adapters an engine serves, pushed to every frontend as they change.

A frontend learns an engine's adapters from its EngineInfo when it connects; a load or unload made
through another frontend (or any client of LoadLoraAdapter / UnloadLoraAdapter) reaches it through this
stream: the current set as the first message, then the whole set again after each change. Sending the
whole set (never a delta) makes every message enough on its own: a frontend that missed one is right
again with the next.

Invariants:
- `LoraAnnouncer.changed()` is called (on the server's event loop) after every load or unload the
  registry took; every open watch then sends the set as the registry has it, at least once, in order.
- A watch never waits for the engine's step loop: `registry.served()` is a snapshot any thread may take.
- `close()` (the engine shuts down) ends every watch, so no stream holds the server's stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb

from engine_svc.lora.registry import LoRARegistry, ServedAdapter


def adapter_infos(adapters: Iterable[ServedAdapter]) -> list[pb.LoraAdapterInfo]:
    """The wire form of served adapters (EngineInfo.lora_adapter_infos, load/unload answers, the watch)."""
    return [pb.LoraAdapterInfo(lora_name=a.name, lora_id=a.lora_id, fingerprint=a.fingerprint) for a in adapters]


class LoraAnnouncer:
    """Wakes every open watch when the served adapters change."""

    def __init__(self) -> None:
        self.version = 0
        self.closed = False
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """The registry took a load or unload: every watch sends the set again."""
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """End every watch (after what it is sending)."""
        self.closed = True
        self.changed()

    async def watch(self, registry: LoRARegistry) -> AsyncIterator[pb.LoraAdapterSet]:
        """The current set, then the set after each change (changes that come together send it once)."""
        while not self.closed:
            seen, event = self.version, self._changed
            yield pb.LoraAdapterSet(adapters=adapter_infos(registry.served()))
            if self.version == seen:
                await event.wait()


async def watch_stream(announcer: LoraAnnouncer, registry: LoRARegistry | None,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LoraAdapterSet]:
    """The RPC's stream; FAILED_PRECONDITION (set on the call, not raised) without --enable-lora."""
    if registry is None:
        context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
        context.set_details("LoRA is not enabled on this engine: start it with --enable-lora")
        return
    async for adapters in announcer.watch(registry):
        yield adapters
