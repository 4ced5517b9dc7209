"""`vllm.Control`: the parts a serving tier answers (vLLM's control plane, beside `vllm.Inference`).

| RPC | answer |
|---|---|
| GetServerInfo | tandem's version, this process's instance id, and the ready engines' shape: the smallest max_model_len, the first engine's block size and TP size, KV blocks / seats / batch tokens summed over the ready engines; no LoRA, no RL |
| GetModelInfo | the served model's name; text and token-id prompts; LoRA when the engines serve adapters; no multimodal; the server's --tool-call-parser |
| Abort | ends the `vllm.Inference` calls in flight with those request ids (inflight.py); unknown ids are ignored |
| ListLoras | the adapters the ready engines serve (ids 1, 2, ... by place in that list; the source path of those loaded through this frontend) |
| LoadLora, UnloadLora | with VLLM_ALLOW_RUNTIME_LORA_UPDATING, what /v1/load_lora_adapter and /v1/unload_lora_adapter do (frontend_svc/engines/lora_admin.py), with the engines' status codes; else FAILED_PRECONDITION |
| GetKvEventSources | one source per ready engine: tandem's `SubscribeKvEvents` gRPC stream at the engine's address (transport "grpc", encoding "protobuf", docs/architecture.md "KV-cache events") |
| IsPaused | paused while the frontend drains (it takes no new requests, as a paused vLLM server) |
| IsSleeping | never: a frontend does not put engines to sleep |
| Shutdown, Pause/Resume, Sleep/WakeUp, the weight-update RPCs | UNIMPLEMENTED: an engine's life and weights are not a client's to change through a frontend |
"""

from __future__ import annotations

import importlib.metadata
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.vendor.vllm import control_pb2 as cpb
from tandem.vendor.vllm import control_pb2_grpc as cpb_grpc

from frontend_svc.engines.lora_admin import (
    RUNTIME_UPDATES_ENV,
    LoraAdmin,
    LoraAdminError,
    runtime_updates_allowed,
)
from frontend_svc.generation import GenerationBackend
from frontend_svc.vllm_grpc.inflight import InFlight

SERVICE_NAME = cpb.DESCRIPTOR.services_by_name["Control"].full_name
API_VERSION = "v1"
KV_EVENTS_TOPIC = epb.DESCRIPTOR.services_by_name["EngineCoreService"].methods_by_name["SubscribeKvEvents"].full_name
# The RPCs a frontend does not serve (every other one is a method of `ControlServicer`).
NOT_SERVED = ("Shutdown", "PauseGeneration", "ResumeGeneration", "Sleep", "WakeUp",
              "InitWeightTransferEngine", "StartWeightUpdate", "StartDraftWeightUpdate", "UpdateWeights",
              "FinishWeightUpdate", "UpdateWeightVersion", "GetWeightVersion")


class ControlServicer(cpb_grpc.ControlServicer):
    def __init__(self, frontend: GenerationBackend, in_flight: InFlight, tool_call_parser: str | None = None) -> None:
        self._f = frontend
        self._in_flight = in_flight
        self._tool_call_parser = tool_call_parser or ""
        self._instance_id = uuid.uuid4().hex
        self._version = importlib.metadata.version("tandem")

    async def GetServerInfo(self, request: cpb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> cpb.ServerInfo:
        infos = [info for _, info in self._f.ready_engine_infos()]
        info = cpb.ServerInfo(engine_version=f"tandem {self._version}", api_version=API_VERSION,
                              instance_id=self._instance_id, max_model_len=self._f.max_model_len)
        if infos:
            first = infos[0]
            info.kv_block_size = first.block_size
            info.effective_attention_block_size = first.block_size
            info.total_kv_blocks = sum(i.num_blocks for i in infos)
            info.max_running_requests = sum(i.max_num_seqs for i in infos)
            info.max_batched_tokens = sum(i.max_num_batched_tokens for i in infos)
            tp, pp = first.tensor_parallel_size or 1, first.pipeline_parallel_size or 1
            info.parallelism.CopyFrom(cpb.ParallelismInfo(
                tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=len(infos),
                data_parallel_size_local=len(infos), decode_context_parallel_size=1,
                world_size=tp * pp * len(infos)))
        return info

    async def GetModelInfo(self, request: cpb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> cpb.ModelInfo:
        name = self._f.model_name
        return cpb.ModelInfo(model_id=name, served_model_name=name, supports_text_input=True,
                             supports_token_ids_input=True, supports_lora=bool(self._f.lora_adapters),
                             supports_multimodal=False,
                             tool_call_parser=self._tool_call_parser)

    async def Abort(self, request: cpb.AbortRequest, context: grpc.aio.ServicerContext) -> cpb.AbortResponse:
        self._in_flight.abort(request.request_ids)
        return cpb.AbortResponse()

    async def IsPaused(self, request: cpb.IsPausedRequest, context: grpc.aio.ServicerContext) -> cpb.IsPausedResponse:
        return cpb.IsPausedResponse(paused=self._f.draining)

    async def IsSleeping(self, request: cpb.IsSleepingRequest,
                         context: grpc.aio.ServicerContext) -> cpb.IsSleepingResponse:
        return cpb.IsSleepingResponse(sleeping=False)

    async def ListLoras(self, request: cpb.ListLorasRequest,
                        context: grpc.aio.ServicerContext) -> cpb.ListLorasResponse:
        return cpb.ListLorasResponse(adapters=[self._adapter(name) for name in self._f.lora_adapters])

    async def LoadLora(self, request: cpb.LoadLoraRequest, context: grpc.aio.ServicerContext) -> cpb.LoadLoraResponse:
        await self._change(lambda admin: admin.load(request.lora_name, request.source_path), context)
        return cpb.LoadLoraResponse(adapter=self._adapter(request.lora_name))

    async def UnloadLora(self, request: cpb.UnloadLoraRequest,
                         context: grpc.aio.ServicerContext) -> cpb.UnloadLoraResponse:
        adapter = self._adapter(request.lora_name)
        await self._change(lambda admin: admin.unload(request.lora_name), context)
        return cpb.UnloadLoraResponse(adapter=adapter)

    def _adapter(self, name: str) -> cpb.LoraAdapter:
        """`name` as ListLoras lists it: its 1-based place among the served adapters (0 when not served)."""
        served = self._f.lora_adapters
        return cpb.LoraAdapter(lora_id=served.index(name) + 1 if name in served else 0, lora_name=name,
                               source_path=self._f.lora_admin.source_path(name))

    async def _change(self, change: Callable[[LoraAdmin], Awaitable[None]], context: grpc.aio.ServicerContext) -> None:
        """A run-time LoRA change (the HTTP API's, frontend_svc/engines/lora_admin.py), with the engines' status."""
        if not runtime_updates_allowed():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"loading and unloading LoRA adapters at run "
                                f"time is off: start the server with {RUNTIME_UPDATES_ENV}=true")
        try:
            await change(self._f.lora_admin)
        except LoraAdminError as exc:
            await context.abort(exc.code, exc.message)

    async def GetKvEventSources(self, request: cpb.GetKvEventSourcesRequest,
                                context: grpc.aio.ServicerContext) -> cpb.GetKvEventSourcesResponse:
        return cpb.GetKvEventSourcesResponse(sources=[
            cpb.KvEventSource(transport="grpc", endpoint=address, topic=KV_EVENTS_TOPIC, encoding="protobuf",
                              schema_version=1)
            for address, _ in self._f.ready_engine_infos()])


def _not_served(name: str) -> Any:
    async def refuse(self: ControlServicer, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"vllm.Control/{name} is not served by a tandem frontend")
        raise AssertionError("abort returned")
    refuse.__name__ = name
    return refuse


for _name in NOT_SERVED:
    setattr(ControlServicer, _name, _not_served(_name))
