"""frontend_svc/engines/lora_admin.py's replay on an engine that joins: what this frontend loaded and the
engine lacks is loaded there, except a load every ready engine has dropped since (its workers could not
read it, engine_svc/lora/runtime_loads.py): that one is forgotten; with no engine ready, all is replayed."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.engines.lora_admin import LoraAdmin


class _Connection:
    def __init__(self, adapters: list[str]) -> None:
        self.info = epb.EngineInfo(lora_adapters=adapters)


class _Engines:
    def __init__(self, ready: list[_Connection]) -> None:
        self.ready = ready
        self.prepare_session: Any = None

    def ready_engines(self) -> list[_Connection]:
        return self.ready


class _JoiningStub:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    async def LoadLoraAdapter(self, request: epb.LoadLoraAdapterRequest, timeout: float) -> epb.LoadLoraAdapterResponse:
        self.loaded.append(request.lora_name)
        return epb.LoadLoraAdapterResponse(lora_adapters=self.loaded)


def _replayed(ready: list[_Connection]) -> list[str]:
    admin = LoraAdmin(_Engines(ready), "base")  # type: ignore[arg-type]
    admin._loaded.update(kept="/a/kept", dropped="/a/dropped")  # loaded through this frontend earlier
    stub = _JoiningStub()
    asyncio.run(admin.replay(stub, epb.EngineInfo()))
    return stub.loaded


def test_a_load_every_ready_engine_dropped_is_not_replayed_on_a_joiner() -> None:
    assert _replayed([_Connection(["kept"])]) == ["kept"]


def test_with_no_engine_ready_every_load_is_replayed() -> None:
    assert _replayed([]) == ["kept", "dropped"]
