"""The engine's KV-cache events (engine_svc/api/kv_events.py) in SMG's shape (`smg.grpc.common.KvEventBatch`).

One subscription of the same `KvEventPublisher` tandem frontends follow; each batch is converted as it is
sent, on the event loop:
- live batches keep their numbers (1, 2, 3, ... per engine process, no gap);
- the snapshot a subscription starts with keeps its chunks (the first begins with a clear), marked as
  SMG's `KvSnapshotChunk`s whose numbers end at the snapshot's sequence, as SMG's relay numbers them
  (while the engine has published fewer batches than there are chunks, every chunk carries the
  snapshot's own number);
- a block hash is tandem's 16-byte hash folded to SMG's int64: its first 8 bytes, little-endian, signed
  (SMG matches removals to stores by this number; prefixes by the token ids it receives);
- blocks computed under a LoRA adapter say so as SMG's fields do: the set's `lora_name` (the cache
  namespace SMG folds into its own hashes), each block's `lora_id` (the engine's id of it) and its
  `extra_keys` (the keys beyond the token ids that went into tandem's hash: "lora" and the adapter's
  content fingerprint, as text);
- the load after each live batch's step rides along (`EngineLoad`: running, waiting, KV usage, the
  admission window), so the gateway need not poll GetLoads.
A subscriber that falls behind is dropped with RESOURCE_EXHAUSTED and must subscribe again;
FAILED_PRECONDITION when the engine runs with --no-enable-kv-cache-events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb
from tandem.vendor.smg import common_pb2 as cpb

from engine_svc.api.kv_events import KvEventPublisher, stream_kv_events
from shared_runtime.kv_hash import lora_extra_keys


def smg_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little", signed=True)


def to_smg_batch(batch: pb.KvEventBatch, block_size: int, max_running: int) -> cpb.KvEventBatch:
    """One tandem batch as SMG's (see the module docstring for the numbering of snapshot chunks)."""
    out = cpb.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, dp_rank=0)
    if batch.HasField("snapshot"):
        chunk = batch.snapshot
        first = batch.sequence_number + 1 - chunk.count
        if first >= 1:
            out.sequence_number = first + chunk.index
        out.snapshot.index, out.snapshot.count, out.snapshot.blocks = chunk.index, chunk.count, chunk.num_blocks
    for event in batch.events:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            stored = out.events.add().stored
            source = event.stored
            if source.parent_block_hash:
                stored.parent_block_hash = smg_hash(source.parent_block_hash)
            for block in source.blocks:
                added = stored.blocks.add(block_hash=smg_hash(block.block_hash), token_ids=block.token_ids,
                                          block_size=block_size)
                if source.lora_name:
                    added.lora_id = source.lora_id
                    for key in lora_extra_keys(source.lora_fingerprint):
                        added.extra_keys.add(text=key)
            if source.lora_name:
                stored.lora_name = source.lora_name
        elif kind == "removed":
            out.events.add().removed.block_hashes.extend(smg_hash(h) for h in event.removed.block_hashes)
        else:
            out.events.add().cleared.SetInParent()
    if batch.HasField("scheduler_stats"):
        stats = batch.scheduler_stats
        out.load.running_requests, out.load.waiting_requests = stats.num_running, stats.num_waiting
        out.load.token_usage = stats.kv_cache_usage
        out.load.max_running_requests = max_running
        if stats.spec_decode_num_drafts:  # speculative decoding: tokens per verification, drafts accepted
            out.load.speculative.accept_length = 1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts
            out.load.speculative.accept_rate = (stats.spec_decode_num_accepted_tokens
                                                / max(1, stats.spec_decode_num_draft_tokens))
    return out


async def smg_batches(publisher: KvEventPublisher | None, block_size: int, max_running: int,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.KvEventBatch]:
    async for batch in stream_kv_events(publisher, context):
        yield to_smg_batch(batch, block_size, max_running)
