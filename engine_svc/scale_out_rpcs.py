"""The engine's scale-out RPCs, behind `EngineCoreServicer` (server.py): SubscribeKvEvents and GetTokenizer.

- `stream_kv_events`: one subscription of the `KvEventPublisher` (kv_publisher.py) as a server stream: a
  snapshot, then live batches; RESOURCE_EXHAUSTED when the subscriber fell too far behind (it must
  subscribe again), FAILED_PRECONDITION when events are off.
- `stream_tokenizer`: the tokenizer archive (tokenizer_files.py) in chunks of at most
  `tokenizer_bundle.CHUNK_BYTES` (`TokenizerArchive.chunks`), the total size on the first and the SHA-256 on the last.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb

from engine_svc.kv_publisher import KvEventPublisher, SubscriberDropped
from engine_svc.tokenizer_files import TokenizerArchive

logger = logging.getLogger(__name__)


async def stream_kv_events(publisher: KvEventPublisher | None,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvEventBatch]:
    if publisher is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "KV cache events are off on this engine (--no-enable-kv-cache-events)")
        return
    subscription = publisher.subscribe()
    try:
        async for batch in subscription.batches():
            yield batch
    except SubscriberDropped:
        logger.warning("a KV event subscriber fell more than %d batches behind; dropped it", publisher.buffer)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"this subscriber fell more than {publisher.buffer} batches behind the engine's KV "
                            "cache events and was dropped; subscribe again for a fresh snapshot")


async def stream_tokenizer(archive: asyncio.Future[TokenizerArchive | None] | None, model_name: str,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenizerChunk]:
    found = await archive if archive is not None else None
    if found is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, "this engine's model has no tokenizer files to serve "
                            "(no tokenizer.json, or a .gguf file without a tokenizer); start the frontend "
                            "with --model")
        return
    for piece, first, last in found.chunks():
        yield pb.TokenizerChunk(data=piece, total_size=len(found.data) if first else 0,
                                model_name=model_name if first else "", sha256=found.sha256 if last else "")
