"""Grammar compiles in processes of their own (engine_svc/structured/compile_farm.py), on the tiny llama's
vocabulary: nested schemas far past the request bounds (shared_runtime/grammar_bounds.py refuses them
before any compile; here they are submitted to the compilers directly) take tens of seconds even there
(400 nested objects ~17 s, 800 nested arrays ~38 s).

Checked: a compiled grammar comes back usable (its matcher accepts what the regex allows); a compile past
its deadline fails and its process is killed; fresh compiles run while two long ones are paused; a
released (aborted) compile is killed; a compile over the memory bound is killed; and through a served
engine, a victim stream keeps its pace and another client's constraint compiles while two slow ones
hold the compiles (before: both threads busy for minutes, every other constraint failed at 30 s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_svc.structured.compiler import GrammarCompilers, GrammarError, Ticket
from engine_svc.structured.grammar import RequestGrammar
from shared_runtime.contract import StructuredOutputs
from tests.support import wait_until

VOCAB = 512


def nested_objects(depth: int) -> StructuredOutputs:
    return StructuredOutputs(json='{"type":"object","required":["a"],"properties":{"a":' * depth
                             + '{"type":"integer"}' + "}}" * depth)


def nested_arrays(depth: int) -> StructuredOutputs:
    return StructuredOutputs(json='{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth)


def settle(compilers: GrammarCompilers, ticket: Ticket, timeout: float = 60.0) -> object:
    """The ticket's grammar once done (GrammarError if it failed); AssertionError past `timeout`."""
    wait_until(lambda: ticket.done, timeout, "the compile to end", interval=0.05)
    try:
        return compilers.result(ticket)
    finally:
        compilers.release(ticket)


@pytest.fixture(scope="module")
def compilers(llama_dir: Path) -> Iterator[GrammarCompilers]:
    """Two running compiles, two paused at most; warmed: three processes started (a start takes seconds,
    which is not what these tests measure)."""
    compilers = GrammarCompilers(str(llama_dir), VOCAB, processes=True, timeout_s=60.0)
    settle(compilers, compilers.submit(StructuredOutputs(regex="[0-9]{3}")), 120)
    assert farm(compilers).spawned == 1  # started when a compile needed one, not before
    farm(compilers).warm(3)
    wait_until(lambda: len(farm(compilers)._idle) == 3, 120, "the farm's processes ready")
    yield compilers
    compilers.shutdown()


def farm(compilers: GrammarCompilers):  # type: ignore[no-untyped-def]
    assert compilers._farm is not None
    return compilers._farm


def test_a_grammar_compiled_in_a_process_masks_like_one_compiled_here(compilers: GrammarCompilers,
                                                                      llama_dir: Path) -> None:
    import torch
    import xgrammar as xgr

    constraint = StructuredOutputs(regex="(yes|no)[0-9]{2}")
    remote = settle(compilers, compilers.submit(constraint))
    local = xgr.GrammarCompiler(compilers._get_info(), max_threads=1, cache_enabled=False).compile_regex(
        "(yes|no)[0-9]{2}")
    masks = []
    for grammar in (remote, local):
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)
        RequestGrammar(grammar, [2]).fill(bitmask, 0)
        masks.append(bitmask.clone())
    assert torch.equal(masks[0], masks[1]) and int((masks[0] != 0).sum()) > 0


def test_fresh_compiles_run_while_two_long_ones_wait_and_a_released_one_is_killed(
        compilers: GrammarCompilers) -> None:
    """Before: two slow constraints held both compile threads for minutes, and every other client's
    constraint failed "did not compile within 30 s"."""
    f = farm(compilers)
    killed = f.killed
    slow = [compilers.submit(nested_objects(400)), compilers.submit(nested_arrays(800))]
    try:
        time.sleep(2.0)  # both run past the farm's patience
        for i in range(3):
            start = time.monotonic()
            settle(compilers, compilers.submit(StructuredOutputs(regex=f"[a-c]{{{i + 2}}}x")), 30)
            took = time.monotonic() - start
            print(f"[compile] a fresh regex beside two long compiles: {took:.2f} s ({f.counts()})")
            assert took < 10, f"a fresh compile waited {took:.1f} s"
        assert f.counts()["running"] + f.counts()["paused"] == 2
        assert f.counts()["processes"] <= f.workers + f.max_paused
    finally:
        for ticket in slow:
            compilers.release(ticket)  # nobody waits for them: their processes are killed
    wait_until(lambda: f.counts()["running"] + f.counts()["paused"] == 0 and f.killed == killed + 2, 10,
               "the released compiles killed")
    assert all(t.future.cancelled() for t in slow)


def test_a_compile_past_its_deadline_fails_and_its_process_is_killed(llama_dir: Path) -> None:
    compilers = GrammarCompilers(str(llama_dir), VOCAB, processes=True, timeout_s=120.0)
    try:
        settle(compilers, compilers.submit(StructuredOutputs(regex="a")), 120)  # a process up (seconds)
        compilers.timeout_s = 4.0
        start = time.monotonic()
        with pytest.raises(GrammarError, match="did not compile within 4 s"):
            settle(compilers, compilers.submit(nested_arrays(800)), 30)
        assert 3.5 < time.monotonic() - start < 8
        assert farm(compilers).killed == 1 and farm(compilers).counts()["running"] == 0
    finally:
        compilers.shutdown()


def test_a_compile_over_the_memory_bound_is_killed(llama_dir: Path) -> None:
    compilers = GrammarCompilers(str(llama_dir), VOCAB, processes=True, timeout_s=60.0)
    try:
        settle(compilers, compilers.submit(StructuredOutputs(regex="a")), 120)
        f = farm(compilers)
        idle = max(w.resident_bytes() for w in f._idle)
        f.memory_bytes = idle + 48 * 2**20  # 800 nested arrays grow a process by ~150 MB
        with pytest.raises(GrammarError, match="needed more than"):
            settle(compilers, compilers.submit(nested_arrays(800)), 60)
        assert f.killed == 1
    finally:
        compilers.shutdown()


# ---- through a served engine ----------------------------------------------------------------------------

def test_a_served_engine_compiles_others_constraints_while_two_slow_ones_run(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's attack, through SMG's protocol on a served engine, with the request bounds lifted (so
    the slow schemas reach the compilers): another client's regex compiles in seconds, the slow ones fail
    INVALID_ARGUMENT at their deadline with their processes killed, and a victim stream keeps its pace."""
    import concurrent.futures

    import grpc
    from tandem.vendor.smg import vllm_engine_pb2 as vpb
    from tandem.vendor.smg import vllm_engine_pb2_grpc as vpb_grpc

    from engine_svc.api.server import EngineServer
    from engine_svc.config import EngineConfig
    from shared_runtime import grammar_bounds
    from tests.engine.test_engine_hostile import SmgVictim
    from tests.engine.test_engine_server import ServerThread
    from tests.engine_stream import engine_idle
    from tests.support import MAX_STALL_S, max_gap

    monkeypatch.setattr(grammar_bounds, "MAX_SCHEMA_NESTING", 10_000)
    grammar_bounds.json_schema_problem.cache_clear()
    config = EngineConfig.create(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=8,
                                 block_size=16, num_gpu_blocks_override=256)
    running = ServerThread(EngineServer(config, host="127.0.0.1", port=0)).start()
    try:
        wait_until(lambda: engine_idle(running.address), 60, "engine up", retry_on=(grpc.RpcError,))
        stub = vpb_grpc.VllmEngineStub(running.channel())

        def generate(request_id: str, **constraint: str) -> str:
            request = vpb.GenerateRequest(request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=[5, 6]),
                                          sampling_params=vpb.SamplingParams(max_tokens=3, **constraint))
            try:
                list(stub.Generate(request, timeout=120))
                return "OK"
            except grpc.RpcError as exc:
                return f"{exc.code().name}: {exc.details()}"

        assert generate("warm", regex="[0-9]+") == "OK"
        grammars = running.server.servicer.core.grammars  # type: ignore[union-attr]
        if grammars._farm is not None:  # (processes take seconds to start: not what is measured here)
            grammars._farm.warm(3)
            wait_until(lambda: len(grammars._farm._idle) == 3, 120, "the compile processes ready")
        grammars.timeout_s = 10.0
        victim = SmgVictim(stub)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            start = time.monotonic()
            slow = [pool.submit(generate, "objects", json_schema=nested_objects(400).json or ""),
                    pool.submit(generate, "arrays", json_schema=nested_arrays(800).json or "")]
            time.sleep(2.0)
            asked = time.monotonic()
            other = generate("other", regex="(yes|no)")
            answered = time.monotonic() - asked
            outcomes = [f.result() for f in slow]
            end = time.monotonic()
        time.sleep(0.05)
        gap_s = max_gap(victim.arrivals, start, end)
        victim.stop()
        print(f"[compile] another client's regex answered in {answered:.2f} s beside two slow schemas; "
              f"victim max gap {1000 * gap_s:.0f} ms over {end - start:.1f} s; slow ones: {outcomes}")
        assert other == "OK" and answered < 8
        assert all(o.startswith("INVALID_ARGUMENT") and "did not compile within 10 s" in o for o in outcomes)
        farm_ = grammars._farm
        assert farm_ is not None
        wait_until(lambda: farm_.counts()["running"] + farm_.counts()["paused"] == 0, 10, "the slow compiles killed")
        assert gap_s < MAX_STALL_S, f"victim stalled {gap_s * 1000:.0f} ms"
    finally:
        running.begin_drain()
        assert running.join(30) == 0


def test_a_process_that_cannot_start_fails_the_queued_compiles_at_once(llama_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Not one start after another until the deadline: the compiles waiting for it fail with the reason."""
    from engine_svc.structured import compile_farm

    monkeypatch.setattr(compile_farm.sys, "executable", "/bin/false")
    compilers = GrammarCompilers(str(llama_dir), VOCAB, processes=True, timeout_s=60.0)
    try:
        start = time.monotonic()
        with pytest.raises(GrammarError, match="grammar compile process"):
            settle(compilers, compilers.submit(StructuredOutputs(regex="a")), 30)
        assert time.monotonic() - start < 10 and farm(compilers).spawned == 1
    finally:
        compilers.shutdown()
