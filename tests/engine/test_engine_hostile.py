"""What a client of the engine's own port could still do to everyone else (a real tiny engine in process,
over gRPC, a victim SMG stream during every attack): refused calls kept in reference cycles, unread
subscribers and tokenizer downloads without a cap, stop-string automata built on the event loop.

Memory is this process's resident size (the engine runs in it), read after a few attacks (the
allocator's arenas grow to their working size over the first ones) and again after many more.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc
from tandem.vendor.smg import common_pb2 as cpb
from tandem.vendor.smg import vllm_engine_pb2 as vpb
from tandem.vendor.smg import vllm_engine_pb2_grpc as vpb_grpc

from engine_svc.api.server import EngineServer
from engine_svc.config import EngineConfig
from tests.engine.test_engine_server import ServerThread
from tests.engine_stream import engine_idle
from tests.support import MAX_STALL_S, max_gap, wait_until

TIMEOUT = 60.0
MiB = 2**20


@pytest.fixture(scope="module")
def model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a 4 MB tokenizer_config.json: a tokenizer download that outlasts grpc's flow
    control window, as a real tokenizer's does (an unread one then holds its place)."""
    out = tmp_path_factory.mktemp("big-tokenizer") / "model"
    shutil.copytree(llama_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["x_padding"] = "p" * (4 * MiB)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[ServerThread]:
    """Four sequences at once and two waiting: an n=64 call is refused RESOURCE_EXHAUSTED. At most 8 KV
    event subscribers and 4 tokenizer downloads at once."""
    config = EngineConfig.create(model=str(model_dir), dtype="float32", device="cpu", max_num_seqs=4,
                                 block_size=16, num_gpu_blocks_override=512)
    running = ServerThread(EngineServer(config, host="127.0.0.1", port=0, max_waiting=2, max_kv_event_subscribers=8,
                                        max_tokenizer_downloads=4)).start()
    wait_until(lambda: engine_idle(running.address), 60, "engine up", retry_on=(grpc.RpcError,))
    yield running
    running.begin_drain()
    assert running.join(15) == 0


@pytest.fixture(scope="module")
def stub(engine: ServerThread) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(engine.channel())


def request(request_id: str, prompt: list[int], **sampling: object) -> vpb.GenerateRequest:
    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **sampling}
    return vpb.GenerateRequest(request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=prompt),
                               sampling_params=vpb.SamplingParams(**params), stream=True)


class SmgVictim:
    """Greedy SMG streams read one after another on a thread of their own until `stop` (the tiny model
    runs one to its end in seconds); `arrivals` are the times of their chunks."""

    def __init__(self, stub: vpb_grpc.VllmEngineStub) -> None:
        self.stub = stub
        self.arrivals: list[float] = []
        self.error: grpc.RpcError | None = None
        self._stopping = threading.Event()
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        wait_until(lambda: len(self.arrivals) >= 5, 30, "victim streaming")

    def _read(self) -> None:
        while not self._stopping.is_set():
            self._call = self.stub.Generate(request(f"victim-{random.random()}", [5, 6, 7], max_tokens=1900),
                                            timeout=300)
            try:
                for _ in self._call:
                    self.arrivals.append(time.monotonic())
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    self.error = exc
                return

    def during(self, label: str, action: object) -> tuple[object, float]:
        start = time.monotonic()
        result = action()  # type: ignore[operator]
        end = time.monotonic()
        time.sleep(0.05)
        gap = max_gap(self.arrivals, start, end)
        print(f"[stall] {label}: victim max gap {1000 * gap:.1f} ms over {end - start:.2f} s")
        return result, gap

    def stop(self) -> None:
        self._stopping.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(10)
        assert self.error is None, self.error


@pytest.fixture
def victim(engine: ServerThread, stub: vpb_grpc.VllmEngineStub) -> Iterator[SmgVictim]:
    reader = SmgVictim(stub)
    yield reader
    reader.stop()
    wait_until(lambda: engine_idle(engine.address), 30, "engine idle")


def resident() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- refused calls leave nothing behind ------------------------------------------------------------------

@pytest.mark.slow
def test_refused_smg_calls_are_freed_by_reference_counting_alone(stub: vpb_grpc.VllmEngineStub,
                                                                 victim: SmgVictim) -> None:
    """Before: each refused call's abort exception (kept by grpc in the call's state) held the handler's
    frame, so its request, plan and answer - n copies of the prompt - until a full collection (40 calls
    x n=64 x 2,000 ids grew the engine ~80 MB a round; here 8 rounds of 20 grew this process ~1 GB).
    (Ten calls a round here: the admitted ones' prefill shares the 2 cores with the victim.)
    With the collector off, nothing may stay."""
    rng = random.Random(0)
    prompt = [rng.randrange(10, 500) for _ in range(2000)]

    def one_round(round_: int) -> list[grpc.StatusCode]:
        def call(i: int) -> grpc.StatusCode:
            try:
                list(stub.Generate(request(f"r{round_}-{i}", prompt, n=64, max_tokens=1, temperature=1.0),
                                   timeout=TIMEOUT))
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                return exc.code()

        with ThreadPoolExecutor(10) as pool:
            return list(pool.map(call, range(10)))

    gc.collect()
    gc.disable()
    try:
        for r in range(5):  # the allocator's arenas reach their working size
            one_round(r)
        settled = resident()
        codes, gap = victim.during("8 rounds of 10 refused n=64 calls",
                                   lambda: [c for r in range(5, 13) for c in one_round(r)])
        grown = resident() - settled
    finally:
        gc.enable()
    refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)  # type: ignore[union-attr]
    print(f"[memory] {refused} refused calls; resident +{grown / MiB:.1f} MiB after 8 more rounds")
    assert refused >= 8 * 7
    assert grown < 24 * MiB, f"refused calls left {grown / MiB:.0f} MiB behind"
    assert gap < MAX_STALL_S, f"victim stalled {gap * 1000:.0f} ms"


# ---- stop strings --------------------------------------------------------------------------------------

def test_fresh_stop_strings_are_compiled_off_the_event_loop(engine: ServerThread, stub: vpb_grpc.VllmEngineStub,
                                                           victim: SmgVictim, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: SMG's stop checkers (an Aho-Corasick automaton over 16 fresh 1,024-character strings: tens of
    ms of pure Python) were built on the server's event loop: 100 such calls stalled every stream."""
    from shared_runtime import stop

    built_on: list[str] = []
    build = stop.StopAutomaton.__init__

    def recording(self: stop.StopAutomaton, stops: object) -> None:
        built_on.append(threading.current_thread().name)
        build(self, stops)  # type: ignore[arg-type]

    monkeypatch.setattr(stop.StopAutomaton, "__init__", recording)
    rng = random.Random(3)
    stops = [["".join(rng.choice("abcdefghij") for _ in range(1024)) for _ in range(16)] for _ in range(100)]

    def call(i: int) -> int:
        """Completes received (2), or 0 when admission refused the call (after its checkers were built)."""
        try:
            chunks = list(stub.Generate(request(f"stops-{i}", [5, 6, 7], max_tokens=4, stop=stops[i], n=2,
                                                temperature=1.0), timeout=TIMEOUT))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            return 0
        return sum(1 for c in chunks if c.HasField("complete"))

    def attack() -> list[int]:
        with ThreadPoolExecutor(100) as pool:
            return list(pool.map(call, range(100)))

    completes, gap = victim.during("100 calls x 16 fresh stop strings", attack)
    assert set(completes) <= {0, 2} and completes.count(2) >= 4  # type: ignore[union-attr]
    assert len(built_on) == 100 and "engine-server-test" not in built_on, set(built_on)  # the loop's thread
    assert gap < MAX_STALL_S, f"victim stalled {gap * 1000:.0f} ms"


# ---- unread subscribers and downloads -------------------------------------------------------------------

def test_kv_event_subscribers_and_tokenizer_downloads_are_capped(engine: ServerThread, stub: vpb_grpc.VllmEngineStub,
                                                                  victim: SmgVictim) -> None:
    """Before: every unread SubscribeKvEvents stream pinned a copy of the prefix cache's snapshot (+0.68 MB
    at 8k blocks) and 200 unread GetTokenizer calls held +367 MB, without limit. Now both protocols share
    one cap per kind (8 and 4 here): past it, RESOURCE_EXHAUSTED; a place comes back when a call ends."""
    for i in range(6):  # some cached blocks for the snapshot
        list(stub.Generate(request(f"fill-{i}", list(range(20 + 40 * i, 60 + 40 * i)), max_tokens=1), timeout=TIMEOUT))
    channel = engine.channel()
    tandem = epb_grpc.EngineCoreServiceStub(channel)

    def subscribe(i: int) -> grpc.Future:
        if i % 2:
            return tandem.SubscribeKvEvents(epb.SubscribeKvEventsRequest(), timeout=TIMEOUT)
        return stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=TIMEOUT)

    def download(i: int) -> grpc.Future:
        if i % 2:
            return tandem.GetTokenizer(epb.GetTokenizerRequest(), timeout=TIMEOUT)
        return stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=TIMEOUT)

    def refused(calls: list[grpc.Future]) -> int:
        wait_until(lambda: sum(c.done() for c in calls) >= len(calls) - limit, 15, "the refusals")
        time.sleep(0.2)
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls if c.done())
        return sum(c.done() for c in calls)

    held: list[grpc.Future] = []
    try:
        for open_call, limit in ((subscribe, 8), (download, 4)):
            calls = [open_call(i) for i in range(limit)]  # never read: each holds its place
            held += calls
            time.sleep(0.5)
            assert not any(c.done() for c in calls)
            settled = resident()
            more, gap = victim.during(f"200 more {open_call.__name__} calls",
                                      lambda open_call=open_call: [open_call(i) for i in range(200)])
            assert refused(more) == 200  # type: ignore[arg-type]
            grown = resident() - settled
            print(f"[memory] {limit} unread {open_call.__name__} calls open, 200 refused: resident "
                  f"+{grown / MiB:.1f} MiB")
            assert grown < 24 * MiB
            assert gap < MAX_STALL_S, f"victim stalled {gap * 1000:.0f} ms"
            calls[0].cancel()  # one ends: its place is free again
            time.sleep(0.3)
            again = open_call(1)
            held.append(again)
            time.sleep(0.5)
            assert not again.done() or again.code() == grpc.StatusCode.OK
    finally:
        for call in held:
            call.cancel()
        channel.close()
