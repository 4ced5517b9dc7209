"""LoRA adapters loaded and unloaded at run time across every engine of a frontend (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, and Control.LoadLora / UnloadLora of its gRPC API).

`LoraAdmin.load` refuses an empty name or path, the base model's name and (without load_inplace) a served
name with vLLM's messages, then sends `LoadLoraAdapter` to every ready engine; when one refuses, the engines that took
it unload it again and the refusal is reported (the first engine's status and message), so the engines
keep serving the same adapters. `unload` refuses an empty or unknown name, then sends `UnloadLoraAdapter` to every ready engine: NOT_FOUND when
none served the name. Each engine's answer lists the adapters it serves afterwards, which becomes that
connection's `info.lora_adapters` (what /v1/models and routing read), so a new name is usable as soon as
the call returns and an unloaded one is refused at once. One change runs at a time.

Engines that join later, or come back after a restart, learn the adapters loaded through this frontend
before they become routable: `replay` (the connection's session hook) loads each one the engine does not
list; an engine that refuses one is not routed to (its session fails and is retried). Unloads are not
replayed: a restarted engine serves its --lora-modules (an unloaded one included) plus what is replayed. Another frontend in front of the
same engines learns of a change from the engines' WatchLoraAdapters streams (lora_watch.py), at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import grpc
from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.engines.client import EngineClient, EngineConnection
from frontend_svc.engines.lora_watch import set_adapters

logger = logging.getLogger(__name__)

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's flag: the load/unload APIs exist only with it
RPC_TIMEOUT_S = 120.0  # reading and checking an adapter of a large model takes a while


def runtime_updates_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's reading of the flag: "1" or "true" (any case, spaces ignored)."""
    return environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


class LoraAdminError(Exception):
    """A load or unload refused (or failed): the gRPC status and the engine's (or frontend's) message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LoraAdmin:
    def __init__(self, engines: EngineClient, model_name: str) -> None:
        self._engines = engines
        self._model_name = model_name
        self._loaded: dict[str, str] = {}  # name -> path, loaded through this frontend (replayed on joiners)
        self._lock = asyncio.Lock()
        engines.prepare_session = self.replay

    async def load(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Serve the adapter at `path` (a path on the engines' hosts) as `name` on every ready engine."""
        request = epb.LoadLoraAdapterRequest(lora_name=name, lora_path=path, load_inplace=load_inplace)
        if not name or not path:
            raise LoraAdminError(grpc.StatusCode.INVALID_ARGUMENT, "Both 'lora_name' and 'lora_path' must be provided.")
        if name == self._model_name:
            raise LoraAdminError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"The lora adapter '{name}' conflicts with a served base model.")
        async with self._lock:
            connections = self._ready()
            if not load_inplace and name in self.served():
                raise LoraAdminError(grpc.StatusCode.ALREADY_EXISTS, f"The lora adapter '{name}' has already been "
                                     "loaded. If you want to load the adapter in place, set 'load_inplace' to True.")
            results = await asyncio.gather(*(self._call(c, "LoadLoraAdapter", request) for c in connections),
                                           return_exceptions=True)
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                if not load_inplace:  # a fresh name: take it back where it was loaded
                    undo = epb.UnloadLoraAdapterRequest(lora_name=name)
                    await asyncio.gather(*(self._call(c, "UnloadLoraAdapter", undo)
                                           for c, r in zip(connections, results) if not isinstance(r, BaseException)),
                                         return_exceptions=True)
                raise _as_admin_error(failure)
            self._loaded[name] = path

    async def unload(self, name: str) -> None:
        """Stop serving `name` on every ready engine (requests already running under it finish)."""
        request = epb.UnloadLoraAdapterRequest(lora_name=name)
        if not name:
            raise LoraAdminError(grpc.StatusCode.INVALID_ARGUMENT,
                                 "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            connections = self._ready()
            if name not in self.served():
                raise LoraAdminError(grpc.StatusCode.NOT_FOUND, f"The lora adapter '{name}' cannot be found.")
            results = await asyncio.gather(*(self._call(c, "UnloadLoraAdapter", request) for c in connections),
                                           return_exceptions=True)
            self._loaded.pop(name, None)
            failures = [_as_admin_error(r) for r in results if isinstance(r, BaseException)]
            others = [f for f in failures if f.code is not grpc.StatusCode.NOT_FOUND]
            if others:
                raise others[0]
            if len(failures) == len(results):  # served nowhere
                raise failures[0]

    def served(self) -> tuple[str, ...]:
        """The adapters the ready engines serve (their union, the first engine's order first)."""
        names = (n for c in self._engines.ready_engines() if c.info is not None for n in c.info.lora_adapters)
        return tuple(dict.fromkeys(names))

    def source_path(self, name: str) -> str:
        """The path `name` was loaded from through this frontend ("" for --lora-modules adapters)."""
        return self._loaded.get(name, "")

    async def replay(self, stub: Any, info: epb.EngineInfo) -> None:
        """Before a (re)connected engine becomes routable: load what this frontend loaded and it lacks.
        Raises (an RpcError) when it refuses one: the session fails and is retried later. It holds the lock
        of loads and unloads, and the engine becomes ready without awaiting anything after it returns, so a
        change either waits for it (and finds the engine ready) or was replayed by it."""
        async with self._lock:
            await self._replay(stub, info)

    async def _replay(self, stub: Any, info: epb.EngineInfo) -> None:
        """Loads what this frontend loaded and `info`'s engine lacks; a load that every ready engine has
        dropped since (its workers could not read it, or another frontend unloaded it) is forgotten, not
        replayed (with no engine ready, as when the only one restarts, everything is replayed)."""
        served = self.served()
        others = any(c.info is not None for c in self._engines.ready_engines())
        for name, path in list(self._loaded.items()):
            if name in info.lora_adapters:
                continue
            if others and name not in served:
                del self._loaded[name]
                continue
            answer = await stub.LoadLoraAdapter(epb.LoadLoraAdapterRequest(lora_name=name, lora_path=path),
                                                timeout=RPC_TIMEOUT_S)
            _set_adapters(info, answer)
            logger.info("LoRA adapter %r loaded on a joining engine", name)

    def _ready(self) -> list[EngineConnection]:
        connections = [c for c in self._engines.ready_engines() if c.stub is not None]
        if not connections:
            raise LoraAdminError(grpc.StatusCode.UNAVAILABLE, "no engine is ready; retry shortly")
        return connections

    async def _call(self, connection: EngineConnection, method: str, request: Any) -> Any:
        answer = await getattr(connection.stub, method)(request, timeout=RPC_TIMEOUT_S)
        if connection.info is not None:
            _set_adapters(connection.info, answer)
        return answer


def _set_adapters(info: epb.EngineInfo,
                  answer: epb.LoadLoraAdapterResponse | epb.UnloadLoraAdapterResponse) -> None:
    set_adapters(info, answer.lora_adapters, answer.lora_adapter_infos)


def _as_admin_error(exc: BaseException) -> LoraAdminError:
    if isinstance(exc, LoraAdminError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        return LoraAdminError(exc.code(), exc.details() or exc.code().name)
    return LoraAdminError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
