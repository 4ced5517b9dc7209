"""`EngineCoreService/PullKvBlocks`: a producer engine streams the K/V blocks it keeps for a finished
prefill to the consumer engine that pulls them (engine_svc/kv_transfer/).

The call takes the lease first (NOT_FOUND when there is none: never made, pulled, aborted or expired), so
that every pull, however it ends - a refused layout, a cancelled stream, the last chunk sent - ends its
lease exactly once and the blocks go back to the pool. The blocks are read into host memory span by span
off the event loop (engine_svc/kv_transfer/source.py), each span sent in chunks of at most
`kv_chunk_bytes` as soon as it is read; the first chunk names the block and token counts and the checksum
span, the last carries each span's CRC-32 (engine_svc/kv_transfer/checksum.py) - or, when the caller
accepts it and this engine has one, the bytes go over the side channel
(engine_svc/kv_transfer/side_channel.py), straight from the cache's memory when it allows
(`KVConnector.block_views`), and the stream carries the counts, the ticket and the sums only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb

from engine_svc.kv_transfer.connector import KVConnector
from engine_svc.kv_transfer.puller import layout_from_pb
from engine_svc.kv_transfer.source import PullSource


async def stream_kv_blocks(connector: KVConnector | None, request: pb.PullKvBlocksRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvBlocksChunk]:
    if connector is None or connector.leases is None or connector.layout is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "this engine keeps no K/V for other engines (--kv-transfer-config kv_role "
                            "kv_producer or kv_both)")
        return
    leases = connector.leases
    lease = leases.begin_pull(request.request_id)
    if lease is None:
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"no K/V kept for request {request.request_id!r} (never kept, already pulled, "
                            "aborted, or its lease expired)")
        return
    try:
        problem = connector.layout.mismatch(layout_from_pb(request.layout))
        if problem is None and request.lora_name != lease.request.lora_name:
            problem = (f"lora_name: the K/V was computed under adapter {lease.request.lora_name or '(base model)'!r}, "
                       f"the caller's request runs under {request.lora_name[:128] or '(base model)'!r}")
        if problem is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
            return
        num_blocks = -(-lease.num_tokens // connector.block_size)
        block_ids = lease.block_ids[request.first_block:num_blocks]
        source = PullSource(connector.read_blocks, block_ids, connector.layout.block_bytes,
                            in_pieces=connector.reads_in_pieces, views=connector.block_views,
                            host_buffer=connector.host_buffer)
        header = {"num_blocks": len(block_ids), "num_tokens": lease.num_tokens,
                  "checksum_span_bytes": source.span_bytes}
        side = connector.side_channel if request.accept_side_channel and block_ids else None
        if side is not None:  # the bytes over the side channel, the control here
            ticket, transfer = side.offer(source.pieces())
            try:
                yield pb.KvBlocksChunk(side_port=side.port, side_ticket=ticket, **header)
                if not await asyncio.to_thread(transfer.done.wait, connector.config.kv_pull_timeout_s):
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the side channel was not read in time")
                if transfer.error is not None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"the side channel failed: {transfer.error}")
                yield pb.KvBlocksChunk(span_crc32=source.crcs)
            finally:
                source.stop()
                side.withdraw(ticket)
            return
        size = connector.config.kv_chunk_bytes
        spans = iter(source)
        while (span := await asyncio.to_thread(next, spans, None)) is not None:
            for start in range(0, len(span), size):
                yield pb.KvBlocksChunk(data=bytes(span[start:start + size]), **header)
                header = {}
        yield pb.KvBlocksChunk(span_crc32=source.crcs, **header)
    finally:
        leases.end_pull(request.request_id)
