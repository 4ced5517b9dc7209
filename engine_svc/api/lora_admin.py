"""`LoadLoraAdapter` / `UnloadLoraAdapter` on the engine: LoRA adapters loaded and unloaded at run time.

A load validates the adapter directory off the busy loop (a thread: the files are read and checked as
--lora-modules' are, engine_svc/lora/peft_dir.py, against the model's config), then registers it on the
busy loop between two steps (`LoRARegistry.add`, a dict update); the workers read it when the next step
runs (engine_svc/lora/registry.py). A refused load changes nothing. An unload only takes the name away
(the registry drops the weights once no request uses them), so it never waits for a step.

Status codes (each message names the adapter): FAILED_PRECONDITION without --enable-lora; INVALID_ARGUMENT
for a bad name or path, or an adapter the engine cannot serve; NOT_FOUND when the directory holds no
adapter (vLLM's message) or, on unload, for an unknown name; ALREADY_EXISTS for a served name;
RESOURCE_EXHAUSTED past --max-cpu-loras; UNAVAILABLE while the engine loads or after it stopped.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb

from engine_svc.api.lora_watch import adapter_infos
from engine_svc.busy_loop import BusyLoop
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.lora.fingerprint import adapter_fingerprint
from engine_svc.lora.modules import LoRAArgumentError, check_lora_modules
from engine_svc.lora.peft_dir import CONFIG_FILE, LoRAAdapterError, validate_for_model
from engine_svc.lora.registry import LoRARegistry, LoRARegistryError, ServedAdapter

CALL_TIMEOUT_S = 30.0  # a busy loop that does not answer within this is stopped or wedged
_STATUS = {"exists": grpc.StatusCode.ALREADY_EXISTS, "not_found": grpc.StatusCode.NOT_FOUND,
           "capacity": grpc.StatusCode.RESOURCE_EXHAUSTED}


async def load(config: EngineConfig, busy: BusyLoop | None, core: EngineCore | None,
               request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext) -> pb.LoadLoraAdapterResponse:
    registry = await _registry(busy, core, context)
    name, path = request.lora_name, request.lora_path
    try:
        check_lora_modules([(name, path)])
    except LoRAArgumentError as exc:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc).replace("--lora-modules ", "lora_name "))
    if not os.path.isabs(path):
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                     f"lora_path {path[:256]!r}: must be an absolute path on the engine's host")
    if not (Path(path) / CONFIG_FILE).is_file():  # vLLM's LoRAAdapterNotFoundError
        await _abort(context, grpc.StatusCode.NOT_FOUND, f"Loading lora {name} failed: No adapter found for {path}")
    try:
        fingerprint = await asyncio.get_running_loop().run_in_executor(None, _checked_fingerprint, config, name, path)
    except LoRAAdapterError as exc:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    answer = await _on_loop(busy, lambda _: _answer(pb.LoadLoraAdapterResponse,
                                                    registry.add(name, path, replace=request.load_inplace,
                                                                 fingerprint=fingerprint),
                                                    registry), context)
    assert isinstance(answer, pb.LoadLoraAdapterResponse)
    return answer


async def unload(busy: BusyLoop | None, core: EngineCore | None, request: pb.UnloadLoraAdapterRequest,
                 context: grpc.aio.ServicerContext) -> pb.UnloadLoraAdapterResponse:
    registry = await _registry(busy, core, context)
    if not request.lora_name:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "lora_name: needed to unload a LoRA adapter")
    answer = await _on_loop(busy, lambda _: _answer(pb.UnloadLoraAdapterResponse, registry.remove(request.lora_name),
                                                    registry), context)
    assert isinstance(answer, pb.UnloadLoraAdapterResponse)
    return answer


if TYPE_CHECKING:
    Answer = pb.LoadLoraAdapterResponse | pb.UnloadLoraAdapterResponse


def _checked_fingerprint(config: EngineConfig, name: str, path: str) -> str:
    """Validate the adapter against the model, then fingerprint its files (a worker thread: both read it)."""
    validate_for_model(config.model, config.architecture, config.max_lora_rank, name, path)
    try:
        return adapter_fingerprint(path)
    except OSError as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {path}: {exc}") from exc


def _answer(kind: type[Answer], served: ServedAdapter, registry: LoRARegistry) -> Answer:
    """What a load or unload answers (built on the busy loop's thread, where the registry lives)."""
    adapters = registry.served()
    return kind(lora_name=served.name, lora_id=served.lora_id, lora_adapters=[a.name for a in adapters],
                lora_adapter_infos=adapter_infos(adapters))


async def _registry(busy: BusyLoop | None, core: EngineCore | None,
                    context: grpc.aio.ServicerContext) -> LoRARegistry:
    if busy is None or core is None:
        await _abort(context, grpc.StatusCode.UNAVAILABLE, "engine is still loading")
    if core.loras is None:  # type: ignore[union-attr]
        await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                     "LoRA is not enabled on this engine: start it with --enable-lora")
    return core.loras  # type: ignore[union-attr, return-value]


async def _on_loop(busy: BusyLoop | None, fn: Callable[[EngineCore], Answer],
                   context: grpc.aio.ServicerContext) -> Answer:
    """`fn(core)` on the busy loop's thread; its LoRARegistryError as the matching status."""
    assert busy is not None
    try:
        answer = await asyncio.wait_for(asyncio.wrap_future(busy.call(fn)), CALL_TIMEOUT_S)
        assert isinstance(answer, (pb.LoadLoraAdapterResponse, pb.UnloadLoraAdapterResponse))
        return answer
    except LoRARegistryError as exc:
        await _abort(context, _STATUS[exc.kind], str(exc))
    except asyncio.TimeoutError:
        await _abort(context, grpc.StatusCode.UNAVAILABLE, "the engine is not stepping (stopped or stopping)")
    raise AssertionError("unreachable")


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("abort returned")
