"""A frontend's view of the LoRA adapters one engine serves, kept current by the engine's
`WatchLoraAdapters` stream.

The engine sends the whole set of adapters it serves (names, ids, content fingerprints) when the stream
opens and again after every run-time load or unload, whoever made it: another frontend, vLLM's gRPC
Control API on another frontend, a client of the engine's own API. `follow_lora_adapters` writes each set
into the connection's `EngineInfo` (`lora_adapters`, `lora_adapter_infos`), which /v1/models, the
model-name checks of every API and routing (router.py) read. So an adapter loaded through frontend A is
served by frontend B as soon as B hears of it (milliseconds), without reconnecting, and one unloaded
through A is refused by B with a 404 from then on. (A request B sends in that window is answered by the
engine: an adapter it no longer serves is refused with an error naming it.)

An engine that does not serve the stream (one that predates it: UNIMPLEMENTED, or runs without
--enable-lora: FAILED_PRECONDITION) is left as its EngineInfo described it. A stream that breaks is
opened again after a short backoff; its first message makes the view exact again.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable

import grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

logger = logging.getLogger(__name__)

RESUBSCRIBE_INITIAL_S = 0.05
RESUBSCRIBE_MAX_S = 2.0
_NOT_SERVED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)


def set_adapters(info: epb.EngineInfo, names: Iterable[str], infos: Iterable[epb.LoraAdapterInfo]) -> None:
    """Replace what `info` says the engine serves (names in id order, and their ids and fingerprints)."""
    del info.lora_adapters[:]
    info.lora_adapters.extend(names)
    del info.lora_adapter_infos[:]
    info.lora_adapter_infos.extend(infos)


async def follow_lora_adapters(stub: epb_grpc.EngineCoreServiceStub, info: epb.EngineInfo, address: str) -> None:
    """Keep `info`'s adapters equal to the engine's until cancelled; returns if the engine serves no
    such stream."""
    backoff = RESUBSCRIBE_INITIAL_S
    while True:
        try:
            async for served in stub.WatchLoraAdapters(epb.WatchLoraAdaptersRequest()):
                set_adapters(info, (a.lora_name for a in served.adapters), served.adapters)
                backoff = RESUBSCRIBE_INITIAL_S
            reason = "the engine ended the stream"
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _NOT_SERVED:
                return
            reason = f"{exc.code().name}: {exc.details()}"
        logger.warning("engine %s: LoRA adapter stream restarts: %s", address, reason)
        await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
        backoff = min(backoff * 2, RESUBSCRIBE_MAX_S)
