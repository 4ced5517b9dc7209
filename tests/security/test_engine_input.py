"""What a stray client can send the engine's `Connect` (issue 22). Before: one 60 MB add was parsed and
copied into a Python list (+1.9 GB, other streams stalled ~8 s) under a 64 MiB receive limit, and a
malformed stream ended with OK.

An engine process on a tiny model (its RSS is its own), raw bytes on a generic gRPC call, and a victim
stream on another connection whose gaps are measured.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb

from shared_runtime.link import MIN_ENGINE_RECEIVE_BYTES, engine_receive_limit
from tests.engine_stream import EngineStream, engine_idle
from tests.support import MAX_STALL_S, Service, free_port, max_gap, wait_until

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 2048


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def raw_add(request_id: str, num_ids: int) -> bytes:
    """An EngineCoreInput add with `num_ids` prompt ids of value 1 (one byte each), built without a list."""
    request = field(1, request_id.encode()) + field(2, b"\x01" * num_ids)
    return field(1, request)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    port = free_port()
    service = Service("engine", [sys.executable, "-m", "engine_svc.cli", "--model", str(tiny_model_dir),
                                 "--port", str(port), "--dtype", "float32", "--metrics-port", "0",
                                 "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(8 << 20)],
                      port, tmp_path_factory.mktemp("engine-input")).start()
    service.wait_serving(120)
    yield service
    service.stop()


def connect_raw(channel: grpc.Channel) -> grpc.StreamStreamMultiCallable:
    return channel.stream_stream("/tandem.engine.v1.EngineCoreService/Connect",
                                 request_serializer=lambda b: b, response_deserializer=epb.EngineCoreOutputs.FromString)


def vm(pid: int, key: str) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def test_the_receive_limit_follows_max_model_len() -> None:
    assert engine_receive_limit(MAX_MODEL_LEN) == MIN_ENGINE_RECEIVE_BYTES
    assert engine_receive_limit(1 << 20) == 5 * (1 << 20) + 64 * 1024  # an add of 1 Mi ids still fits
    assert engine_receive_limit(1 << 24) == 64 * 1024 * 1024  # never above --max-message-bytes


def test_a_60_mb_add_is_refused_without_memory_or_a_stall(engine: Service) -> None:
    assert engine.proc is not None
    pid = engine.proc.pid
    with grpc.insecure_channel(engine.address) as victim_channel, grpc.insecure_channel(
            engine.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        victim = EngineStream(victim_channel)
        victim.add("victim", [5, 6, 7], max_tokens=MAX_MODEL_LEN - 3)
        victim.wait(lambda: len(victim.messages) >= 5)
        payload = raw_add("big", 60 * 1024 * 1024)
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets the engine's peak RSS
        before = vm(pid, "VmHWM")
        start = time.monotonic()
        call = connect_raw(channel)(iter([payload]), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        end = time.monotonic()
        grown = vm(pid, "VmHWM") - before
        arrivals = list(victim.arrivals)
        victim.abort("victim")
        victim.close()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    assert grown < 50 * 2**20, f"engine peak RSS grew {grown / 2**20:.0f} MiB"
    gap = max_gap(arrivals, start, end)
    print(f"[stall] victim max gap {gap * 1000:.0f} ms over {end - start:.2f} s; engine RSS +{grown / 2**20:.1f} MiB")
    assert gap < MAX_STALL_S, f"victim stalled {gap * 1000:.0f} ms"
    wait_until(lambda: engine_idle(engine.address), 10, "every block back")


def test_an_add_over_max_model_len_is_rejected_alone(engine: Service) -> None:
    """Within the receive limit (4 MiB here) but over max_model_len: refused (counted, never copied into a
    list) with an error output for it alone; the stream and its other requests carry on."""
    with grpc.insecure_channel(engine.address) as channel:
        stream = EngineStream(channel)
        stream.add("fine", [5, 6, 7], max_tokens=4)
        stream.send(epb.EngineCoreRequest(request_id="long", prompt_token_ids=[1] * (3 * 1024 * 1024)))
        stream.add("also-fine", [5, 6, 7], max_tokens=4)
        for rid in ("fine", "long", "also-fine"):
            stream.wait_finished(rid)
        [out] = stream.outputs("long")
        assert out.error.code == epb.ERROR_CODE_INVALID_ARGUMENT and "max_model_len" in out.error.message
        assert len(stream.tokens("fine")) == len(stream.tokens("also-fine")) == 4 and stream.error is None
        stream.close()


def test_an_add_with_a_million_stop_ids_is_refused_before_they_are_copied(engine: Service) -> None:
    """Past max(max_model_len, COPY_FREELY) entries a list is counted and refused, never made a Python list;
    a smaller excess gets the full rules (tests/engine/test_engine_server.py)."""
    with grpc.insecure_channel(engine.address) as channel:
        stream = EngineStream(channel)
        sampling = epb.EngineSamplingParams(stop_token_ids=[1] * 1_000_000, max_tokens=4)
        stream.send(epb.EngineCoreRequest(request_id="stops", prompt_token_ids=[5, 6], sampling_params=sampling))
        stream.add("fine", [5, 6, 7], max_tokens=4)
        for rid in ("stops", "fine"):
            stream.wait_finished(rid)
        [out] = stream.outputs("stops")
        assert out.error.code == epb.ERROR_CODE_INVALID_ARGUMENT
        assert out.error.message == "sampling_params.stop_token_ids: 1000000 entries are too many to read"
        assert len(stream.tokens("fine")) == 4 and stream.error is None
        stream.close()


@pytest.mark.parametrize("payload", [b"\x0a\xff\xff\xff\xff\x0f", b"", raw_add("\n" * 600, MAX_MODEL_LEN + 1)],
                         ids=["undecodable", "no-kind", "oversized-with-a-bad-id"])
def test_a_malformed_connect_stream_ends_with_invalid_argument(engine: Service, payload: bytes) -> None:
    with grpc.insecure_channel(engine.address) as channel:
        call = connect_raw(channel)(iter([payload]), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
