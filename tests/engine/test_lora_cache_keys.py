"""LoRA adapters in the prefix-cache key, as a frontend computes it, and in the KV events of both protocols.

The real engine (tiny llama, PEFT adapters, prefix caching, blocks of 4) keys an adapter request's blocks
by the adapter's content fingerprint (engine_svc/lora/fingerprint.py); the oracle for "the frontend
computes the engine's hashes" is the engine's own stored records: the hashes the frontend derives from
EngineInfo.lora_adapter_infos with the router's function equal them block for block, and its cache view
built from them matches the whole prompt for that adapter (and an identical copy of it under another
name), nothing for the base model or another adapter. The stored records, tandem's KV event batches
(live and snapshot) and SMG's KvBlocksStored name the adapter.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from tandem.engine.v1 import engine_core_pb2 as epb

from engine_svc.api.kv_events import KvEventPublisher, events_to_pb
from engine_svc.api.lora_watch import LoraAnnouncer, adapter_infos
from engine_svc.api.smg.kv_events import smg_hash, to_smg_batch
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.kv.events import BlockAdapter, StoredBlock
from engine_svc.lora.fingerprint import adapter_fingerprint
from engine_svc.lora.registry import LoRARegistry
from engine_svc.request import Request
from frontend_svc.engines.client import EngineConnection
from frontend_svc.engines.router import block_hash_keys, cached_prefix_tokens
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams
from shared_runtime.kv_hash import iter_block_hashes, lora_extra_keys
from tests.engine.lora_support import ALL_MODULES, make_adapter, make_prompts

BS = 4
PROMPT_BLOCKS = 6


@pytest.fixture(scope="module")
def adapters(make_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    model_dir = make_model("llama")
    root = tmp_path_factory.mktemp("cache-key-adapters")
    x = make_adapter(model_dir, root / "x", rank=8, alpha=16, targets=ALL_MODULES, seed=71)
    twin = root / "twin"
    shutil.copytree(x, twin)  # the same files in another directory
    y = make_adapter(model_dir, root / "y", rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=72)
    return model_dir, {"x": x, "twin": twin, "y": y}


def test_the_fingerprint_is_the_files_content(adapters, tmp_path: Path) -> None:
    _, dirs = adapters
    assert adapter_fingerprint(dirs["x"]) == adapter_fingerprint(dirs["twin"])  # same files, other place
    assert adapter_fingerprint(dirs["x"]) != adapter_fingerprint(dirs["y"])
    edited = tmp_path / "edited"
    shutil.copytree(dirs["x"], edited)
    config = (edited / "adapter_config.json").read_text()
    (edited / "adapter_config.json").write_text(config.replace('"lora_alpha": 16', '"lora_alpha": 17'))
    assert '"lora_alpha": 17' in (edited / "adapter_config.json").read_text()
    assert adapter_fingerprint(edited) != adapter_fingerprint(dirs["x"])  # same weights, other scaling
    model_dir, _ = adapters
    reseeded = make_adapter(model_dir, tmp_path / "reseeded", rank=8, alpha=16, targets=ALL_MODULES, seed=79)
    assert (reseeded / "adapter_config.json").read_bytes() == (dirs["x"] / "adapter_config.json").read_bytes()
    assert adapter_fingerprint(reseeded) != adapter_fingerprint(dirs["x"])  # same config, other weights
    # two engines (registries) reading the same directory announce the same fingerprint
    prints: list[dict[str, str]] = [{}, {}]
    for p in prints:
        LoRARegistry({"x": 1}, [("x", str(dirs["x"]))], 2, set, p)
    assert prints[0] == prints[1] == {"x": adapter_fingerprint(dirs["x"])}


def _request(rid: str, prompt: list[int], lora: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, lora_name=lora,
                             sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


def _run(core: EngineCore, rid: str, prompt: list[int], lora: str) -> int:
    """Run one request to its end; the prompt tokens it found cached."""
    core.add_request(_request(rid, prompt, lora))
    cached = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            cached = max(cached, out.num_cached_tokens)
    return cached


def _frontend_view(core: EngineCore, cached: set[bytes]) -> EngineConnection:
    """A frontend's connection to `core`, as it reads EngineInfo (the servicer's fields) and KV events."""
    assert core.loras is not None
    served = core.loras.served()
    connection = EngineConnection("engine-under-test", client=None)  # type: ignore[arg-type]
    connection.info = epb.EngineInfo(block_size=BS, lora_adapters=[a.name for a in served],
                                     lora_adapter_infos=adapter_infos(served))
    connection.kv_index.blocks = set(cached)
    return connection


def test_the_frontend_hashes_an_adapter_prompt_exactly_as_the_engine_stores_it(adapters) -> None:
    model_dir, dirs = adapters
    config = EngineConfig.create(model=str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8,
                                 max_loras=2, enable_prefix_caching=True, block_size=BS,
                                 lora_modules={name: str(path) for name, path in dirs.items()})
    core = EngineCore(config, kv_events=True)
    assert core.kv_events is not None
    prompt = make_prompts(73, 1, 500, lo=BS * PROMPT_BLOCKS, hi=BS * PROMPT_BLOCKS)[0]
    try:
        assert _run(core, "x1", prompt, "x") == 0
        records = [r for r in core.kv_events.take() if isinstance(r, StoredBlock)]
        fingerprint = adapter_fingerprint(dirs["x"])
        assert [r.adapter for r in records] == [BlockAdapter("x", 1, fingerprint)] * len(records)
        batch = epb.KvEventBatch(sequence_number=1)  # the engine's own records, as both streams send them
        batch.events.extend(events_to_pb(records, BS))
        assert [(e.stored.lora_name, e.stored.lora_id, e.stored.lora_fingerprint) for e in batch.events] \
            == [("x", 1, fingerprint)]
        smg = to_smg_batch(batch, BS, max_running=4).events[0].stored
        assert smg.lora_name == "x" and {b.lora_id for b in smg.blocks} == {1}
        view = _frontend_view(core, {r.block_hash for r in records})
        frontend_hashes = list(iter_block_hashes(prompt, BS, block_hash_keys(view, "x")))
        assert [r.block_hash for r in records][:PROMPT_BLOCKS] == frontend_hashes
        assert block_hash_keys(view, "x") == lora_extra_keys(fingerprint)
        # the frontend's cache view: the whole prompt for x and for an identical copy under another name,
        # nothing for the base model or another adapter
        assert cached_prefix_tokens([view], prompt, "x") == [BS * PROMPT_BLOCKS]
        assert cached_prefix_tokens([view], prompt, "twin") == [BS * PROMPT_BLOCKS]
        assert cached_prefix_tokens([view], prompt, "") == [0]
        assert cached_prefix_tokens([view], prompt, "y") == [0]
        # ... and the engine agrees (its prefix cache hit, or none)
        assert _run(core, "twin1", prompt, "twin") == BS * (PROMPT_BLOCKS - 1)  # the last block is recomputed
        assert _run(core, "base", prompt, "") == 0
        assert _run(core, "y1", prompt, "y") == 0
        assert _run(core, "x2", prompt, "x") == BS * (PROMPT_BLOCKS - 1)
    finally:
        core.shutdown()


def test_an_in_place_reload_gets_a_new_key(adapters) -> None:
    """A name loaded again with other files: the frontend's hashes for it change with the engine's."""
    model_dir, dirs = adapters
    config = EngineConfig.create(model=str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8,
                                 enable_prefix_caching=True, block_size=BS, lora_modules={"a": str(dirs["x"])})
    core = EngineCore(config, kv_events=True)
    assert core.loras is not None and core.kv_events is not None
    prompt = make_prompts(74, 1, 500, lo=BS * 3, hi=BS * 3)[0]
    try:
        _run(core, "old", prompt, "a")
        old = {r.block_hash for r in core.kv_events.take() if isinstance(r, StoredBlock)}
        core.loras.add("a", str(dirs["y"]), replace=True)
        assert cached_prefix_tokens([_frontend_view(core, old)], prompt, "a") == [0]
        assert _run(core, "new", prompt, "a") == 0
        new = [r for r in core.kv_events.take() if isinstance(r, StoredBlock)]
        assert new and all(r.adapter == BlockAdapter("a", 2, adapter_fingerprint(dirs["y"])) for r in new)
        assert cached_prefix_tokens([_frontend_view(core, {r.block_hash for r in new})], prompt, "a") == [BS * 3]
    finally:
        core.shutdown()


def _adapter_records() -> tuple[list[Any], BlockAdapter]:
    """A base-model chain and an adapter's chain for the same tokens (as the engine records them)."""
    adapter = BlockAdapter("sql", 7, "ab" * 32)
    tokens = [(1, 2, 3, 4), (5, 6, 7, 8)]
    base = Request(EngineCoreRequest(request_id="b", prompt_token_ids=[t for b in tokens for t in b],
                                     sampling_params=EngineSamplingParams()), 64)
    base_hashes = list(iter_block_hashes(base.prompt_token_ids, BS))
    lora_hashes = list(iter_block_hashes(base.prompt_token_ids, BS, lora_extra_keys(adapter.fingerprint)))
    records = [StoredBlock(base_hashes[0], None, tokens[0]), StoredBlock(base_hashes[1], base_hashes[0], tokens[1]),
               StoredBlock(lora_hashes[0], None, tokens[0], adapter),
               StoredBlock(lora_hashes[1], lora_hashes[0], tokens[1], adapter)]
    return records, adapter


def test_kv_event_batches_name_the_adapter_live_and_in_snapshots_on_both_protocols() -> None:
    records, adapter = _adapter_records()

    async def scenario() -> tuple[epb.KvEventBatch, epb.KvEventBatch]:
        publisher = KvEventPublisher("engine-1", BS)
        stream = publisher.subscribe().batches()
        await asyncio.wait_for(anext(stream), 5)  # the (empty) snapshot
        publisher.publish(records, None)
        live = await asyncio.wait_for(anext(stream), 5)
        publisher.publish([records[1].block_hash], None)  # evict the base model's second block
        publisher.publish([records[3].block_hash], None)  # ... and the adapter's
        assert publisher.adapters == {records[2].block_hash: adapter}  # no adapter kept for an evicted block
        snapshot = await asyncio.wait_for(anext(publisher.subscribe().batches()), 5)
        return live, snapshot

    live, snapshot = asyncio.run(scenario())
    base_event, lora_event = (e.stored for e in live.events)
    assert (base_event.lora_name, base_event.lora_id, base_event.lora_fingerprint) == ("", 0, "")
    assert (lora_event.lora_name, lora_event.lora_id, lora_event.lora_fingerprint) == tuple(adapter)
    assert [b.block_hash for b in lora_event.blocks] == [records[2].block_hash, records[3].block_hash]
    stored = [e.stored for e in snapshot.events if e.WhichOneof("kind") == "stored"]
    assert [(s.lora_name, [b.block_hash for b in s.blocks]) for s in stored] == [
        ("", [records[0].block_hash]), ("sql", [records[2].block_hash])]
    assert stored[1].lora_id == 7 and stored[1].lora_fingerprint == adapter.fingerprint

    smg = to_smg_batch(live, BS, max_running=4)
    smg_base, smg_lora = (e.stored for e in smg.events)
    assert not smg_base.HasField("lora_name") and not smg_base.blocks[0].HasField("lora_id")
    assert not smg_base.blocks[0].extra_keys
    assert smg_lora.lora_name == "sql"
    assert [b.block_hash for b in smg_lora.blocks] == [smg_hash(records[2].block_hash), smg_hash(records[3].block_hash)]
    for block in smg_lora.blocks:
        assert block.lora_id == 7
        assert [k.text for k in block.extra_keys] == list(lora_extra_keys(adapter.fingerprint))
    smg_snapshot = to_smg_batch(snapshot, BS, max_running=4)
    assert [e.stored.lora_name for e in smg_snapshot.events if e.WhichOneof("data") == "stored"] == ["", "sql"]


def test_the_adapter_watch_sends_the_set_at_once_and_again_after_each_change(adapters) -> None:
    """WatchLoraAdapters' stream (engine_svc/api/lora_watch.py) over a real registry: the set when opened,
    then the whole set after each load or unload; changes made before it is read are sent once, as the
    set is then."""
    _, dirs = adapters
    registry = LoRARegistry({"x": 1}, [("x", str(dirs["x"]))], 4, set, {})
    announcer = LoraAnnouncer()

    def names(message: epb.LoraAdapterSet) -> list[tuple[str, int, str]]:
        return [(a.lora_name, a.lora_id, a.fingerprint[:8]) for a in message.adapters]

    async def scenario() -> None:
        stream = announcer.watch(registry)
        fx, fy = adapter_fingerprint(dirs["x"])[:8], adapter_fingerprint(dirs["y"])[:8]
        assert names(await asyncio.wait_for(anext(stream), 5)) == [("x", 1, fx)]
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not pending.done()  # nothing changed: nothing sent
        registry.add("y", str(dirs["y"]))
        announcer.changed()
        assert names(await asyncio.wait_for(pending, 5)) == [("x", 1, fx), ("y", 2, fy)]
        registry.remove("x")
        announcer.changed()
        registry.add("x", str(dirs["y"]))
        announcer.changed()
        assert names(await asyncio.wait_for(anext(stream), 5)) == [("y", 2, fy), ("x", 3, fy)]
        pending = asyncio.ensure_future(anext(stream))
        announcer.close()  # the engine shuts down: the stream ends
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, 5)

    asyncio.run(scenario())
