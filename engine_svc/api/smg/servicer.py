"""`vllm.grpc.engine.VllmEngine` (SMG's engine protocol) on the engine's gRPC server, beside EngineCoreService.

An SMG gateway (or llm-d's router) tokenizes, renders chat templates, parses tool calls and routes; it
sends token ids to the engine over this protocol, as it does to vLLM's own servicer. Each Generate call
is a stream of its own in the busy loop (`EngineCoreServicer.open_stream`): its requests go through the
same path as a Connect stream's adds (the engine's validation, `--max-waiting` admission, duplicate ids,
drains) and everything of it still running is aborted when the call ends for any reason (the gateway
cancelled it, the client went away, an error). The engine token (docs/security.md) is checked by the
server's interceptor for this service as for EngineCoreService.

- Generate: request.py (request -> engine requests; refusals), answer.py (outputs -> messages),
  stops.py (stop strings, matched on the text in the engine: a matched sample is aborted at once).
- Abort: the named calls' samples are aborted; each call then completes with finish_reason "abort".
- HealthCheck: healthy while the model is loaded and the engine neither draining nor failed.
- GetModelInfo / GetServerInfo / GetLoads: the engine's config and the busy loop's latest stats.
- GetTokenizer: the archive the engine already serves to tandem frontends (a zip of tokenizer.json,
  tokenizer_config.json, ...), in chunks; the SHA-256 on the last.
- SubscribeKvEvents: the engine's KV-cache event stream (engine_svc/api/kv_events.py) in SMG's shape (kv_events.py).
- Embed, FlushCache, StartProfile, StopProfile: UNIMPLEMENTED (tandem serves generation only, keeps no
  profiler, and drops its prefix cache only by eviction).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import grpc
from tandem.vendor.smg import common_pb2 as cpb
from tandem.vendor.smg import vllm_engine_pb2 as vpb
from tandem.vendor.smg import vllm_engine_pb2_grpc as vpb_grpc

from engine_svc.api.smg.answer import EngineFailure, SmgAnswer
from engine_svc.api.smg.kv_events import smg_batches
from engine_svc.api.smg.model_info import ModelFacts, read_model_facts
from engine_svc.api.smg.request import Refused, SmgPlan, plan_request
from engine_svc.api.smg.stops import LazyStopTokenizer, NoTokenizer, SampleStops, sample_stops

if TYPE_CHECKING:
    from engine_svc.api.engine_core import EngineCoreServicer
    from engine_svc.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "vllm-grpc"  # what SMG's vLLM servicer reports; the gateway treats the engine as vLLM
VERSION = "tandem"


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(self, engine: EngineCoreServicer, serving: Callable[[], bool]) -> None:
        """`engine`: the EngineCoreService servicer whose busy loop runs the requests; `serving`: whether
        the engine takes requests (loaded, not draining, not failed)."""
        self.engine = engine
        self.serving = serving
        self.started = time.monotonic()
        self.last_receive = 0.0
        self._calls: dict[str, tuple[int, list[str]]] = {}  # live request id -> (stream id, sample ids)
        self._facts: asyncio.Future[ModelFacts] = asyncio.get_running_loop().run_in_executor(
            None, read_model_facts, engine.config.model)
        self._stop_tokenizer = LazyStopTokenizer(engine.tokenizer)

    async def Generate(self, request: vpb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[vpb.GenerateResponse]:
        """Every way this call fails ends it with `_end` (a status, then return), never `context.abort`:
        grpc keeps an abort's exception in the call's state, and its traceback holds this frame, whose
        request, plan and answer (n copies of the prompt) would then wait for a full garbage collection."""
        busy, core = self.engine.busy, self.engine.core
        if busy is None or core is None:
            _end(context, grpc.StatusCode.UNAVAILABLE, "engine is still loading")
            return
        self.last_receive = time.time()
        facts = await self._facts
        try:
            plan = plan_request(request, max_model_len=core.max_model_len, eos_token_ids=facts.eos_token_ids,
                                arrival_time=time.time())
            stops = await self._stops(plan) if plan.stop else None
        except Refused as exc:
            _end(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        if plan.request_id in self._calls:
            _end(context, grpc.StatusCode.INVALID_ARGUMENT, "duplicate request id: ids must be unique per engine "
                 "while their request runs")
            return
        sid, queue = self.engine.open_stream()
        self._calls[plan.request_id] = (sid, [child.request_id for child in plan.children])
        answer = SmgAnswer(plan, stops)
        try:
            for child in plan.children:
                busy.add(sid, child)
            while not answer.done:
                step = await queue.get()
                if step is None:
                    _end(context, grpc.StatusCode.UNAVAILABLE, "the engine stopped")
                    return
                for out in step.outputs:
                    messages, stopped = answer.on_output(out)
                    if stopped:  # no compute after the match: the engine forgets the sample now
                        busy.abort(sid, [out.request_id], already_ended=True)
                    for message in messages:
                        yield message
        except EngineFailure as exc:
            _end(context, _STATUS.get(exc.code, grpc.StatusCode.INTERNAL), str(exc))
        finally:
            self._calls.pop(plan.request_id, None)
            self.engine.close_stream(sid)

    async def _stops(self, plan: SmgPlan) -> list[SampleStops]:
        """One stop checker per sample (the tokenizer is loaded the first time); Refused without one. Built
        on a worker thread: the stop strings' automaton and the primed detokenizer are pure Python, tens
        of milliseconds for 16 fresh strings of 1,024 characters, which the event loop must not spend."""
        try:
            tokenizer = await self._stop_tokenizer.get()
        except NoTokenizer as exc:
            raise Refused("sampling_params.stop", f"stop strings need the model's tokenizer.json: {exc}") from None
        return await asyncio.to_thread(sample_stops, tokenizer, plan)

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext) -> vpb.AbortResponse:
        busy = self.engine.busy
        for request_id in request.request_ids:
            call = self._calls.get(request_id)
            if call is not None and busy is not None:
                busy.abort(call[0], call[1])
        return vpb.AbortResponse()

    async def HealthCheck(self, request: vpb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vpb.HealthCheckResponse:
        healthy = self.serving()
        return vpb.HealthCheckResponse(healthy=healthy, message="Healthy" if healthy else "engine is not serving "
                                       "(loading, draining or failed)")

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> vpb.GetModelInfoResponse:
        core = self.engine.core
        if core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")
        facts = await self._facts
        cfg = self.engine.config
        return vpb.GetModelInfoResponse(
            model_path=cfg.model, is_generation=True, max_context_length=core.max_model_len,  # type: ignore[union-attr]
            vocab_size=core.vocab_size, supports_vision=False, served_model_name=cfg.model_name,  # type: ignore[union-attr]
            tokenizer_path=cfg.model, model_type=facts.model_type, architectures=facts.architectures,
            eos_token_ids=facts.eos_token_ids, pad_token_id=facts.pad_token_id, bos_token_id=facts.bos_token_id,
            max_req_input_len=core.max_model_len)  # type: ignore[union-attr]

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> vpb.GetServerInfoResponse:
        stats = self.engine.busy.stats if self.engine.busy is not None else None
        cfg = self.engine.config
        return vpb.GetServerInfoResponse(
            active_requests=(stats.num_running + stats.num_waiting) if stats else 0, is_paused=not self.serving(),
            last_receive_timestamp=self.last_receive, uptime_seconds=time.monotonic() - self.started,
            server_type=SERVER_TYPE, data_parallel_size=1, block_size=cfg.block_size,
            model_dtype=cfg.torch_dtype_name, max_num_seqs=cfg.max_num_seqs,
            constrained_decoding_start="first_token", **_kv_fields(cfg.kv_transfer_config, self.engine.engine_id))

    async def GetLoads(self, request: vpb.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> vpb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank: this engine is rank 0 of 1, got "
                                f"{request.dp_rank}")
        stats = self.engine.busy.stats if self.engine.busy is not None else None
        cfg = self.engine.config
        load = vpb.SchedulerLoad(dp_rank=0, max_running_requests=cfg.max_num_seqs)
        if stats is not None:
            load.num_running_reqs, load.num_waiting_reqs = stats.num_running, stats.num_waiting
            load.num_total_reqs = stats.num_running + stats.num_waiting
            load.token_usage = stats.kv_cache_usage
            used = stats.num_total_blocks - stats.num_free_blocks
            load.num_used_tokens, load.max_total_num_tokens = (used * cfg.block_size,
                                                               stats.num_total_blocks * cfg.block_size)
            if stats.prefix_cache_queries:
                load.cache_hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries
        return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=VERSION,
                                    dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request: cpb.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.GetTokenizerChunk]:
        cap = self.engine.tokenizer_downloads  # shared with EngineCoreService's GetTokenizer
        if not cap.take(context):
            return
        try:
            archive = await self.engine.tokenizer if self.engine.tokenizer is not None else None
            if archive is None:
                _end(context, grpc.StatusCode.NOT_FOUND, "this engine's model has no tokenizer files to serve")
                return
            for piece, _, last in archive.chunks():
                yield cpb.GetTokenizerChunk(data=piece, sha256=archive.sha256 if last else "")
        finally:
            cap.give_back()

    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.KvEventBatch]:
        cfg = self.engine.config
        async for batch in smg_batches(self.engine.kv_events, cfg.block_size, cfg.max_num_seqs, context):
            yield batch

    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext) -> vpb.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "tandem serves generation models only: no embeddings")
        raise AssertionError("unreachable")

    async def FlushCache(self, request: cpb.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> cpb.FlushCacheResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "tandem's prefix cache is freed by eviction only")
        raise AssertionError("unreachable")

    async def StartProfile(self, request: cpb.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> cpb.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "tandem's engine has no profiler to start")
        raise AssertionError("unreachable")

    async def StopProfile(self, request: cpb.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> cpb.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "tandem's engine has no profiler to stop")
        raise AssertionError("unreachable")


_STATUS = {code.value[0]: code for code in grpc.StatusCode}  # ErrorCode values are grpc.StatusCode numbers


# The connector name SMG keys its P/D flow on. tandem's GrpcConnector speaks NIXL's handoff (the prefill
# leg tagged do_remote_decode, the kept blocks returned as NIXL's keys, relayed to the decode leg, which
# pulls): that is SMG's "NixlConnector" mode; the bytes move over PullKvBlocks instead of NIXL.
SMG_KV_CONNECTOR = "NixlConnector"


def _kv_fields(config: KVTransferConfig | None, engine_id: str) -> dict[str, str]:
    """GetServerInfo's KV-transfer fields: empty without --kv-transfer-config."""
    if config is None:
        return {}
    return {"kv_connector": SMG_KV_CONNECTOR, "kv_role": config.kv_role, "kv_engine_id": engine_id}


def _end(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """The call's status once the handler returns (what `context.abort` sends, without its exception)."""
    context.set_code(code)
    context.set_details(details)


def add_to_server(servicer: VllmEngineServicer, server: grpc.aio.Server) -> None:
    vpb_grpc.add_VllmEngineServicer_to_server(servicer, server)
