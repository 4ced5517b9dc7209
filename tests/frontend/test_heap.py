"""The frontend settles its heap once it has started: start-up's objects frozen out of the collector's
scans, young collections spaced `GEN0_THRESHOLD` allocations apart, garbage cycles still collected."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import pytest

from frontend_svc import cli
from shared_runtime import heap
from shared_runtime.heap import GEN0_THRESHOLD, GarbageWatch, settle_heap


@pytest.fixture
def restored_gc():
    threshold = gc.get_threshold()
    yield
    heap.stop_garbage_watch()
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_heap_freezes_what_start_up_built_and_still_collects_cycles(restored_gc) -> None:
    built_at_start = {id(table): table for table in ([i] for i in range(1000))}  # lists: tracked objects
    assert sum(id(o) in built_at_start for o in gc.get_objects()) == 1000
    settle_heap()
    assert sum(id(o) in built_at_start for o in gc.get_objects()) == 0  # no collection scans them
    assert gc.get_freeze_count() >= 1000
    assert gc.get_threshold()[0] == GEN0_THRESHOLD > 700

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # type: ignore[attr-defined]
    alive = weakref.ref(cycle)
    del cycle
    assert alive() is not None  # refcounting alone cannot free a cycle
    gc.collect()
    assert alive() is None


class Node:
    pass


def test_the_garbage_watch_collects_once_resident_memory_grew_past_the_slack(restored_gc) -> None:
    """The collector counts objects, not bytes: a cycle holding a big list waits for a full collection.
    The watch runs one when resident memory grew more than its slack since the last."""
    resident = [1000]
    watch = GarbageWatch(slack_bytes=100, resident=lambda: resident[0])
    gc.disable()  # only the watch may collect here
    try:
        cycle = Node()
        cycle.self, cycle.payload = cycle, [0] * 1000  # type: ignore[attr-defined]
        alive = weakref.ref(cycle)
        del cycle
        resident[0] = 1100  # grown by exactly the slack: not yet
        assert not watch.check() and alive() is not None
        resident[0] = 1101
        assert watch.check() and alive() is None and watch.collections == 1
        resident[0] = 1150  # growth counts from the memory after that collection
        assert not watch.check()
        resident[0] = 500  # memory given back lowers the mark
        assert not watch.check()
        resident[0] = 601
        assert watch.check() and watch.collections == 2
    finally:
        gc.enable()


def test_settle_heap_starts_one_garbage_watch(restored_gc) -> None:
    settle_heap()
    first = heap._watch
    settle_heap()
    assert first is not None and heap._watch is first
    assert any(t.name == "garbage-watch" for t in threading.enumerate())
    heap.stop_garbage_watch()
    assert not any(t.name == "garbage-watch" for t in threading.enumerate())


def test_the_frontend_settles_its_heap_after_start_up(monkeypatch, restored_gc, tiny_model_dir) -> None:
    calls: list[str] = []

    class Server:
        def __init__(self, config: Any, telemetry: Any) -> None:
            calls.append("init")

        async def start(self) -> None:
            calls.append("start")

        async def wait_stopped(self) -> None:
            calls.append("serving")

        async def drain(self) -> None: ...

        async def stop(self) -> None: ...

        def reload_credentials(self) -> None: ...

    import frontend_svc.server

    monkeypatch.setattr(frontend_svc.server, "FrontendServer", Server)
    monkeypatch.setattr(cli, "settle_heap", lambda: calls.append("settle"))
    config = cli.config_from_args(cli.build_parser().parse_args(["--model", str(tiny_model_dir), "--engine", "127.0.0.1:1"]))
    assert asyncio.run(cli._serve(config)) == 0
    assert calls == ["init", "start", "settle", "serving"]
