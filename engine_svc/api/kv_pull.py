"""`EngineCoreService/PullKvBlocks`: a producer engine streams the K/V blocks it keeps for a finished
prefill to the consumer engine that pulls them (engine_svc/kv_transfer/).

The call takes the lease first (NOT_FOUND when there is none: never made, pulled, aborted or expired), so
that every pull, however it ends - a refused layout, a cancelled stream, the last chunk sent - ends its
lease exactly once and the blocks go back to the pool. The blocks are copied to host memory off the event
loop, then sent in chunks of at most `kv_chunk_bytes`, the first naming the block and token counts, the
last carrying the SHA-256 of all the bytes - or, when the caller accepts it and this engine has one, the
bytes go over the side channel (engine_svc/kv_transfer/side_channel.py) and the stream carries the
counts, the ticket and the SHA-256 only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from hashlib import sha256

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb

from engine_svc.kv_transfer.connector import KVConnector
from engine_svc.kv_transfer.puller import layout_from_pb


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
        data = await asyncio.to_thread(connector.read_blocks, block_ids) if block_ids else b""
        side = connector.side_channel if request.accept_side_channel and data else None
        if side is not None:  # the bytes over the side channel, the control here
            ticket, transfer = side.offer(data)
            try:
                yield pb.KvBlocksChunk(num_blocks=len(block_ids), num_tokens=lease.num_tokens, side_port=side.port,
                                       side_ticket=ticket)
                digest = await asyncio.to_thread(lambda: sha256(data).hexdigest())  # while the bytes travel
                if not await asyncio.to_thread(transfer.done.wait, connector.config.kv_pull_timeout_s):
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the side channel was not read in time")
                if transfer.error is not None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"the side channel failed: {transfer.error}")
                yield pb.KvBlocksChunk(sha256=digest)
            finally:
                side.withdraw(ticket)
            return
        digest = sha256(data).hexdigest()
        size = connector.config.kv_chunk_bytes
        starts = range(0, max(len(data), 1), size)
        for start in starts:
            chunk = pb.KvBlocksChunk(data=bytes(data[start:start + size]))
            if start == 0:
                chunk.num_blocks, chunk.num_tokens = len(block_ids), lease.num_tokens
            if start == starts[-1]:
                chunk.sha256 = digest
            yield chunk
    finally:
        leases.end_pull(request.request_id)
