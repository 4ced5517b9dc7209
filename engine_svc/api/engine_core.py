"""`tandem.engine.v1.EngineCoreService`: the RPCs a tandem frontend calls (Connect, GetEngineInfo, GetLoad,
SubscribeKvEvents, GetTokenizer, and LoadLoraAdapter / UnloadLoraAdapter: lora_admin.py), in front of the
busy-loop thread.

Each `Connect` stream gets an id and an asyncio queue. The busy loop delivers one `EngineCoreOutputs`
per step per stream (thread-safe hand-off onto the event loop); the stream's writer converts it to
protobuf here (output_packing.py), off the busy loop, and coalesces steps that queued up while it was
writing - into messages of at most `COALESCE_TARGET_BYTES` (or the configured maximum message size, if
smaller), so a slow reader gets more, smaller messages, never one its channel refuses (which would end the
stream and every request on it). A single request's output larger than the maximum is replaced by an
INVALID_ARGUMENT error for that request alone. A stream that ends aborts every request it added.
"""


from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb
from tandem.engine.v1 import engine_core_pb2_grpc as pb_grpc

from engine_svc.api import lora_admin
from engine_svc.api.kv_events import KvEventPublisher, stream_kv_events
from engine_svc.api.kv_pull import stream_kv_blocks
from engine_svc.api.lora_watch import LoraAnnouncer, adapter_infos, watch_stream
from engine_svc.api.output_packing import pack_outputs
from engine_svc.api.stream_cap import DEFAULT_MAX_TOKENIZER_DOWNLOADS, StreamCap
from engine_svc.api.tokenizer_archive import TokenizerArchive, stream_tokenizer
from engine_svc.busy_loop import BusyLoop
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.telemetry.tracing import RequestSpans
from engine_svc.validation import add_size_problem, request_id_problem
from shared_runtime.contract import EngineCoreOutput, EngineCoreOutputs, EngineError, ErrorCode, FinishReason
from shared_runtime.from_pb import request_from_pb
from shared_runtime.link import (
    MAX_MESSAGE_BYTES,
)
from shared_runtime.to_pb import stats_to_load_pb

logger = logging.getLogger(__name__)

COALESCE_TARGET_BYTES = 4 * 1024 * 1024


class _Malformed(ValueError):
    """Input that makes the whole Connect stream unusable (it ends with INVALID_ARGUMENT)."""


@dataclass
class _Stream:
    queue: asyncio.Queue[EngineCoreOutputs | None]
    malformed: str | None = None  # why the stream's input was unusable: it ends with INVALID_ARGUMENT


class EngineCoreServicer(pb_grpc.EngineCoreServiceServicer):
    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_tokenizer_downloads: int = DEFAULT_MAX_TOKENIZER_DOWNLOADS) -> None:
        self.config = config
        self.loop = loop
        self.max_message_bytes = max_message_bytes
        self.message_budget = min(COALESCE_TARGET_BYTES, max_message_bytes)
        self.engine_id = uuid.uuid4().hex[:12]
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)
        self.busy: BusyLoop | None = None
        self.core: EngineCore | None = None
        self.spans: RequestSpans | None = None  # per-request engine spans (None: tracing off)
        self.kv_events: KvEventPublisher | None = None  # None: --no-enable-kv-cache-events
        self.tokenizer: asyncio.Future[TokenizerArchive | None] | None = None
        # GetTokenizer calls at once, both protocols together (an unread one holds a chunk and grpc's buffers)
        self.tokenizer_downloads = StreamCap("GetTokenizer", "--max-tokenizer-downloads", max_tokenizer_downloads)
        self.lora_announcer = LoraAnnouncer()  # wakes WatchLoraAdapters streams after each load / unload

    # Called from the busy-loop thread.
    def deliver(self, stream_id: int, outputs: EngineCoreOutputs) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None:
            self.loop.call_soon_threadsafe(stream.queue.put_nowait, outputs)

    def open_stream(self) -> tuple[int, asyncio.Queue[EngineCoreOutputs | None]]:
        """A stream of its own for a caller beside Connect (SMG's Generate, smg/servicer.py): the busy loop
        delivers the outputs of the requests it adds under this id to the queue; None marks the end."""
        sid = next(self._ids)
        stream = _Stream(asyncio.Queue())
        self._streams[sid] = stream
        return sid, stream.queue

    def close_stream(self, sid: int) -> None:
        """The caller is done with stream `sid`: whatever of it is still running is aborted."""
        self._streams.pop(sid, None)
        if self.busy is not None:
            self.busy.close_stream(sid)

    async def Connect(self, request_iterator: AsyncIterator[pb.EngineCoreInput],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.EngineCoreOutputs]:
        busy = self.busy
        if busy is None or self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")
        sid = next(self._ids)
        stream = _Stream(asyncio.Queue())
        self._streams[sid] = stream
        reader = asyncio.create_task(self._read_inputs(sid, request_iterator))
        ended: set[str] = set()  # requests this stream ended itself (an output too large to send)
        on_oversized = functools.partial(self._drop_oversized, sid, ended)
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    if stream.malformed is not None:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, stream.malformed)
                    return
                steps = self._take_queued(item, stream.queue)
                if ended:  # outputs queued before the busy loop forgot them: nothing follows their end
                    steps = [_without(step, ended) for step in steps]
                if self.spans is not None:
                    for step in steps:
                        self.spans.observe(step)
                for message in pack_outputs(steps, self.message_budget, self.max_message_bytes, on_oversized):
                    yield message
        finally:
            reader.cancel()
            if self.spans is not None:
                self.spans.end_stream(sid)
            self._streams.pop(sid, None)
            busy.close_stream(sid)  # type: ignore[union-attr]

    @staticmethod
    def _take_queued(first: EngineCoreOutputs, q: asyncio.Queue[EngineCoreOutputs | None]) -> list[EngineCoreOutputs]:
        """`first` and the steps that queued behind it while the previous message was written (in order;
        an end-of-stream marker stays queued)."""
        steps = [first]
        while not q.empty():
            nxt = q.get_nowait()
            if nxt is None:
                q.put_nowait(None)
                break
            steps.append(nxt)
        return steps

    def _drop_oversized(self, sid: int, ended: set[str], request_id: str) -> None:
        """A request's output could not be sent (larger than the maximum message) and became its final,
        error, output: stop it in the engine without a second end, and send nothing more of it."""
        logger.warning("stream %d: a request's output exceeded --max-message-bytes (%d); aborting it",
                       sid, self.max_message_bytes)
        ended.add(request_id)
        if self.busy is not None:
            self.busy.abort(sid, [request_id], already_ended=True)

    async def _read_inputs(self, sid: int, request_iterator: AsyncIterator[pb.EngineCoreInput]) -> None:
        """Feed the stream's adds and aborts to the busy loop. An add too large to copy is rejected alone
        (an error output for it). Input that cannot be used at all (undecodable bytes, a message of no
        known kind, an oversized add whose id cannot be echoed) ends the stream with INVALID_ARGUMENT:
        its requests are aborted and the frontend fails them, rather than being left unable to hear aborts."""
        busy = self.busy
        assert busy is not None and self.core is not None
        max_prompt = self.core.max_model_len
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "add":
                    if not self._admit_size(sid, msg.add, max_prompt):
                        continue
                    request = request_from_pb(msg.add)
                    if self.spans is not None:
                        self.spans.start(sid, request)
                    busy.add(sid, request)
                elif kind == "abort":
                    busy.abort(sid, list(msg.abort.request_ids))
                else:
                    raise _Malformed("an EngineCoreInput must hold an add or an abort")
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        except Exception as exc:
            reason = str(exc) if isinstance(exc, _Malformed) else "the stream's input is not valid EngineCoreInput"
            logger.warning("stream %d: bad input (%s: %s); ending the stream", sid, type(exc).__name__, exc)
            stream = self._streams.get(sid)
            if stream is not None:
                stream.malformed = reason
                stream.queue.put_nowait(None)

    def _admit_size(self, sid: int, add: pb.EngineCoreRequest, max_prompt: int) -> bool:
        """False (and the request's INVALID_ARGUMENT output queued) when `add` is too large to copy."""
        problem = add_size_problem(add, max_prompt)
        if problem is None:
            return True
        if request_id_problem(add.request_id) is not None:
            raise _Malformed(f"an add whose request id cannot be echoed is too large: {problem}")
        stream = self._streams.get(sid)
        if stream is not None:
            error = EngineError(code=ErrorCode.INVALID_ARGUMENT, message=problem)
            out = EngineCoreOutput(request_id=add.request_id, finish_reason=FinishReason.ERROR, error=error)
            stream.queue.put_nowait(EngineCoreOutputs(outputs=[out], timestamp=time.time()))
        return False

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.EngineInfo:
        core = self.core
        if core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")
        cfg = self.config
        return pb.EngineInfo(
            model_name=cfg.model_name, max_model_len=core.max_model_len,  # type: ignore[union-attr]
            vocab_size=core.vocab_size, block_size=cfg.block_size, num_blocks=core.num_blocks,  # type: ignore[union-attr]
            tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size,
            dtype=cfg.torch_dtype_name,
            enable_prefix_caching=cfg.enable_prefix_caching, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=int(cfg.max_num_batched_tokens or 0),
            scheduling_policy=cfg.scheduling_policy, device=cfg.device, engine_id=self.engine_id,
            tokenizer_sha256=archive.sha256 if (archive := await self._tokenizer_archive()) else "",
            kv_cache_events=self.kv_events is not None,
            lora_adapters=[a.name for a in core.loras.served()] if core.loras is not None else [],  # type: ignore[union-attr]
            lora_adapter_infos=adapter_infos(core.loras.served()) if core.loras is not None else [],  # type: ignore[union-attr]
            kv_role=cfg.kv_transfer_config.kv_role if cfg.kv_transfer_config else "",
        )

    async def _tokenizer_archive(self) -> TokenizerArchive | None:
        return await self.tokenizer if self.tokenizer is not None else None

    async def SubscribeKvEvents(self, request: pb.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvEventBatch]:
        async for batch in stream_kv_events(self.kv_events, context):
            yield batch

    async def GetTokenizer(self, request: pb.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenizerChunk]:
        async for chunk in stream_tokenizer(self.tokenizer, self.config.model_name, context, self.tokenizer_downloads):
            yield chunk

    async def PullKvBlocks(self, request: pb.PullKvBlocksRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvBlocksChunk]:
        async for chunk in stream_kv_blocks(self.core.kv_connector if self.core else None, request, context):
            yield chunk

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoadLoraAdapterResponse:
        answer = await lora_admin.load(self.config, self.busy, self.core, request, context)
        self.lora_announcer.changed()
        return answer

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> pb.LoadLoraAdapterResponse:
        answer = await lora_admin.unload(self.busy, self.core, request, context)
        self.lora_announcer.changed()
        return answer

    async def WatchLoraAdapters(self, request: pb.WatchLoraAdaptersRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LoraAdapterSet]:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")
        async for adapters in watch_stream(self.lora_announcer, self.core.loras, context):  # type: ignore[union-attr]
            yield adapters

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.EngineLoad:
        return stats_to_load_pb(self.busy.stats if self.busy else None)

    def end_all_streams(self) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(None)


def _without(step: EngineCoreOutputs, request_ids: set[str]) -> EngineCoreOutputs:
    """`step` less the outputs of `request_ids`."""
    return EngineCoreOutputs(outputs=[o for o in step.outputs if o.request_id not in request_ids],
                             scheduler_stats=step.scheduler_stats, timestamp=step.timestamp)
