"""Prefill/decode disaggregation between engines (engine_svc/kv_transfer/), over real gRPC on loopback.

The producer is a served engine (`kv_producer`, driven through Connect); consumers are in-process engine
cores (`kv_consumer`) whose pulls are real `PullKvBlocks` calls to it. The oracle is one unified engine
alone: a request prefilled on the producer (max_tokens=1, `do_remote_decode`) and continued on a consumer
(its first token as output, `do_remote_prefill` naming the producer's blocks) gives exactly the unified
engine's tokens and logprobs - greedy and seeded - while the consumer computes only what it did not pull.
Every KV block comes back on both sides: after the pull, after an abort, after the lease expires.
Failures (a producer that holds nothing, a refused layout, a dead producer) are recomputed by the consumer
(still exact), or end the request with UNAVAILABLE under `kv_load_failure_policy: fail`.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from engine_svc.api.server import EngineServer
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.kv_transfer.config import KVTransferConfig
from engine_svc.kv_transfer.puller import layout_to_pb
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams, KvTransferParams
from shared_runtime.from_pb import kv_transfer_params_from_pb
from tests.engine.test_engine_server import ServerThread
from tests.engine_stream import EngineStream, engine_idle, engine_load
from tests.support import free_port, wait_until

BLOCK_SIZE, NUM_BLOCKS = 4, 64
PROMPT = [5, 9, 14, 22, 31, 40, 47, 51, 60, 66, 71, 80, 85, 90, 97, 101, 3, 7]  # 18 tokens: 4 full blocks + 2
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": 2}
SEEDED = {"temperature": 0.9, "top_p": 0.9, "seed": 1234, "max_tokens": 12, "ignore_eos": True, "logprobs": 1}


def _config(model: Path, kv: KVTransferConfig | None = None, block_size: int = BLOCK_SIZE,
            **more: Any) -> EngineConfig:
    return EngineConfig.create(model=str(model), dtype="float32", device="cpu", max_model_len=256,
                               block_size=block_size, num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=4,
                               kv_transfer_config=kv, **more)


def _serve(config: EngineConfig) -> ServerThread:
    """A served engine on loopback, up and idle."""
    running = ServerThread(EngineServer(config, host="127.0.0.1", port=0)).start()
    wait_until(lambda: engine_idle(running.address), 90, "producer up", retry_on=(grpc.RpcError,))
    return running


def _stop(running: ServerThread) -> None:
    running.begin_drain()
    assert running.join(30) == 0


@pytest.fixture(scope="module")
def producer(llama_dir: Path) -> Iterator[ServerThread]:
    running = _serve(_config(llama_dir, KVTransferConfig(kv_role="kv_producer", kv_lease_duration_s=60)))
    yield running
    _stop(running)


@pytest.fixture(scope="module")
def unified(llama_dir: Path) -> EngineCore:
    return EngineCore(_config(llama_dir))


def _consumer(model: Path, async_scheduling: bool = False, **kv: Any) -> EngineCore:
    return EngineCore(_config(model, KVTransferConfig(kv_role="kv_consumer", kv_pull_timeout_s=10, **kv),
                              async_scheduling=async_scheduling))


def _run(core: EngineCore, request: EngineCoreRequest, timeout: float = 30.0) -> tuple[list[int], list[Any], Any]:
    """(tokens, logprob entries, last output) of `request` alone on `core` (stepping while it pulls)."""
    core.add_request(request)
    tokens: list[int] = []
    logprobs: list[Any] = []
    last = None
    deadline = time.monotonic() + timeout
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request did not finish"
        if not core.has_work():
            time.sleep(0.005)  # its K/V is being pulled
            continue
        for out in core.step().outputs:
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
            last = out
    return tokens, logprobs, last


def _prefill(producer: ServerThread, request_id: str, prompt: list[int], params: dict[str, Any],
             token: str | None = None, lora_name: str = "") -> epb.EngineCoreOutput:
    """Prefill `prompt` on the producer (max_tokens=1, keep the blocks): its one output."""
    with producer.channel() as plain:
        channel = grpc.intercept_channel(plain, _BearerToken(token)) if token else plain
        stream = EngineStream(channel)
        sampling = epb.EngineSamplingParams(**{**params, "max_tokens": 1})
        stream.send(epb.EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling,
                                          kv_transfer_params=epb.KvTransferParams(do_remote_decode=True),
                                          lora_name=lora_name))
        stream.wait_finished(request_id, timeout=30)
        out = stream.last(request_id)
        stream.close()
    assert out is not None and out.error.message == "" and len(out.new_token_ids) == 1
    return out


def _decode_request(request_id: str, prompt: list[int], params: dict[str, Any], first: epb.EngineCoreOutput,
                    **remote: Any) -> EngineCoreRequest:
    """The continuation a frontend sends to the decode engine after `first` (the producer's output)."""
    kv = kv_transfer_params_from_pb(first.kv_transfer_params)
    kv = KvTransferParams(do_remote_prefill=True, **{**{f: getattr(kv, f) for f in kv.__struct_fields__
                                                       if f.startswith("remote_")}, **remote})
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt,
                             sampling_params=EngineSamplingParams(**params),
                             output_token_ids=list(first.new_token_ids), kv_transfer_params=kv)


def _all_free(core: EngineCore) -> bool:
    kv = core.scheduler.kv
    return kv.num_free_blocks == kv.num_blocks and kv.usage == 0


def _assert_close(got: list[Any], want: list[Any]) -> None:
    """Same tokens and top tokens, logprobs within 1e-4 (another batch shape, another TP or a prefix-cache
    hit in the oracle sums in another order)."""
    assert [e.token_id for e in got] == [e.token_id for e in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g.logprob - w.logprob) < 1e-4
        assert list(g.top_token_ids) == list(w.top_token_ids)


def _logprob_rows(entries: list[Any]) -> list[tuple[Any, ...]]:
    return [(e.token_id, e.logprob, e.rank, list(e.top_token_ids), list(e.top_logprobs)) for e in entries]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_there_decode_here_equals_one_engine(producer: ServerThread, unified: EngineCore, llama_dir: Path,
                                                     params: dict[str, Any], async_scheduling: bool) -> None:
    tag = f"{params['temperature']}-{async_scheduling}"
    want, want_logprobs, want_end = _run(unified, EngineCoreRequest(
        request_id=f"u-{tag}", prompt_token_ids=PROMPT, sampling_params=EngineSamplingParams(**params)))
    first = _prefill(producer, f"p-{tag}", PROMPT, params)
    kv = first.kv_transfer_params
    assert first.finish_reason == epb.FINISH_REASON_LENGTH and first.new_token_ids == want[:1]
    assert (kv.remote_num_tokens, len(kv.remote_block_ids), kv.remote_port) == (len(PROMPT), 5, producer.server.bound_port)
    assert engine_load(producer.address).num_free_blocks == NUM_BLOCKS - 5  # held for the pull

    consumer = _consumer(llama_dir, async_scheduling=async_scheduling)
    rest, rest_logprobs, end = _run(consumer, _decode_request("d", PROMPT, params, first))
    assert first.new_token_ids[:] + rest == want
    assert _logprob_rows(list(first.new_logprobs) + rest_logprobs) == _logprob_rows(want_logprobs)  # bit-exact
    assert end.finish_reason == want_end.finish_reason
    connector = consumer.kv_connector
    assert connector is not None and (connector.num_blocks_pulled, connector.num_pull_failures) == (5, 0)
    assert consumer.scheduler.get_stats().prefix_cache_hits == 0
    wait_until(lambda: engine_idle(producer.address), 15, "the producer's blocks freed after the pull")
    assert _all_free(consumer)
    consumer.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_consumer_with_a_draft_model_drafts_over_the_pulled_prompt(producer: ServerThread, unified: EngineCore,
                                                                     llama_dir: Path, async_scheduling: bool) -> None:
    """A decode engine that speculates with a draft model: the pulled blocks bring the target's K/V only, so
    its draft catches up over the pulled prompt in the request's first step. The target as its own draft
    makes every greedy draft right exactly when the draft's K/V is: all are accepted, and the tokens are
    one engine's."""
    want, want_logprobs, _ = _run(unified, EngineCoreRequest(
        request_id=f"u-draft-{async_scheduling}", prompt_token_ids=PROMPT, sampling_params=EngineSamplingParams(**GREEDY)))
    first = _prefill(producer, f"p-draft-{async_scheduling}", PROMPT, GREEDY)
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}
    consumer = EngineCore(_config(llama_dir, KVTransferConfig(kv_role="kv_consumer", kv_pull_timeout_s=10),
                                  speculative_config=spec, async_scheduling=async_scheduling))
    try:
        rest, rest_logprobs, _ = _run(consumer, _decode_request("d-draft", PROMPT, GREEDY, first))
        assert list(first.new_token_ids) + rest == want
        _assert_close(list(first.new_logprobs) + rest_logprobs, want_logprobs)
        connector, stats = consumer.kv_connector, consumer.scheduler.spec_stats
        assert connector is not None and (connector.num_blocks_pulled, connector.num_pull_failures) == (5, 0)
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
        assert _all_free(consumer)
    finally:
        consumer.shutdown()
    wait_until(lambda: engine_idle(producer.address), 15, "the producer's blocks freed after the pull")


def test_the_consumer_pulls_only_what_its_prefix_cache_lacks(producer: ServerThread, unified: EngineCore,
                                                            llama_dir: Path) -> None:
    consumer = _consumer(llama_dir)
    connector = consumer.kv_connector
    assert connector is not None
    _run(consumer, _decode_request("d1", PROMPT, GREEDY, _prefill(producer, "p1", PROMPT, GREEDY)))
    assert connector.num_blocks_pulled == 5
    longer = [*PROMPT, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 27 tokens: 7 blocks, 4 of them cached here
    want, want_logprobs, _ = _run(unified, EngineCoreRequest(
        request_id="u2", prompt_token_ids=longer, sampling_params=EngineSamplingParams(**GREEDY)))
    first = _prefill(producer, "p2", longer, GREEDY)
    rest, rest_logprobs, _ = _run(consumer, _decode_request("d2", longer, GREEDY, first))
    assert list(first.new_token_ids) + rest == want
    assert _logprob_rows(list(first.new_logprobs) + rest_logprobs) == _logprob_rows(want_logprobs)
    assert connector.num_blocks_pulled == 5 + 3  # blocks 4, 5 and 6 only
    assert consumer.scheduler.get_stats().prefix_cache_hits == 4 * BLOCK_SIZE
    wait_until(lambda: engine_idle(producer.address), 15, "the producer's blocks freed after the pull")
    assert _all_free(consumer)
    consumer.shutdown()


@pytest.mark.parametrize("failure", ["nothing_kept", "dead_producer", "layout"])
def test_a_failed_pull_is_recomputed_exactly(producer: ServerThread, unified: EngineCore, llama_dir: Path,
                                             failure: str) -> None:
    want, want_logprobs, _ = _run(unified, EngineCoreRequest(
        request_id=f"u-{failure}", prompt_token_ids=PROMPT, sampling_params=EngineSamplingParams(**GREEDY)))
    first = _prefill(producer, f"p-{failure}", PROMPT, GREEDY)
    remote: dict[str, Any] = {}
    consumer = _consumer(llama_dir)
    if failure == "nothing_kept":
        remote = {"remote_request_id": "never-kept"}
    elif failure == "dead_producer":
        remote = {"remote_port": free_port()}
    else:
        consumer.shutdown()
        consumer = EngineCore(_config(llama_dir, KVTransferConfig(kv_role="kv_consumer"), block_size=8))
    rest, rest_logprobs, _ = _run(consumer, _decode_request(f"d-{failure}", PROMPT, GREEDY, first, **remote))
    assert list(first.new_token_ids) + rest == want
    assert [e.token_id for e in rest_logprobs] == [e.token_id for e in want_logprobs[1:]]
    for got, expected in zip(rest_logprobs, want_logprobs[1:], strict=True):
        assert abs(got.logprob - expected.logprob) < 1e-4  # recomputed: a prefill of its own
    connector = consumer.kv_connector
    assert connector is not None and (connector.num_pull_failures, connector.num_blocks_pulled) == (1, 0)
    assert _all_free(consumer)
    consumer.shutdown()
    if failure != "layout":  # a refused layout ends the lease too; the others leave it to be pulled: pull it
        _pull(producer, f"p-{failure}")
    wait_until(lambda: engine_idle(producer.address), 15, "the producer's blocks freed")


def test_fail_policy_ends_the_request_with_unavailable(producer: ServerThread, llama_dir: Path) -> None:
    first = _prefill(producer, "p-fail", PROMPT, GREEDY)
    consumer = _consumer(llama_dir, kv_load_failure_policy="fail")
    rest, _, end = _run(consumer, _decode_request("d-fail", PROMPT, GREEDY, first, remote_request_id="gone"))
    assert rest == [] and end.error is not None and end.error.code == 14  # UNAVAILABLE
    assert "NOT_FOUND" in end.error.message and "kv_load_failure_policy" in end.error.message
    assert _all_free(consumer)
    consumer.shutdown()
    _pull(producer, "p-fail")
    wait_until(lambda: engine_idle(producer.address), 15, "the producer's blocks freed")


def test_a_layout_mismatch_is_refused_by_name(producer: ServerThread) -> None:
    _prefill(producer, "p-layout", PROMPT, GREEDY)
    layout = producer.server.servicer.core.kv_connector.layout  # type: ignore[union-attr]
    wrong = layout_to_pb(layout)
    wrong.dtype = "bfloat16"
    with pytest.raises(grpc.RpcError) as refused:
        _pull(producer, "p-layout", wrong)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype is 'float32' here and 'bfloat16'" in (refused.value.details() or "")
    wait_until(lambda: engine_idle(producer.address), 15, "a refused pull frees the blocks")
    with pytest.raises(grpc.RpcError) as gone:
        _pull(producer, "p-layout")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_abort_frees_kept_blocks_and_a_pull_in_flight(producer: ServerThread, llama_dir: Path) -> None:
    _prefill(producer, "p-abort", PROMPT, GREEDY)
    assert engine_load(producer.address).num_free_blocks == NUM_BLOCKS - 5
    with producer.channel() as channel:
        stream = EngineStream(channel)
        stream.abort("p-abort")  # the frontend gave up on the request after its prefill
        wait_until(lambda: engine_idle(producer.address), 15, "an abort frees kept blocks")
        stream.close()
    # A consumer's abort while it pulls: nothing stays allocated there, and the producer's lease ends.
    first = _prefill(producer, "p-abort2", PROMPT, GREEDY)
    consumer = _consumer(llama_dir)
    consumer.add_request(_decode_request("d-abort", PROMPT, GREEDY, first))
    consumer.abort_requests(["d-abort"])
    outputs = [o for _ in range(3) for o in consumer.step().outputs]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("d-abort", 3)]  # ABORT, exactly once
    assert not consumer.has_unfinished_requests() and _all_free(consumer)
    consumer.shutdown()
    # The cancelled pull ended the lease if it had reached the producer; if it had not, the lease waits
    # for a pull (or its expiry): pull it. NOT_FOUND: a pull holds or ended it.
    def settled() -> bool:
        if engine_idle(producer.address):
            return True
        try:
            _pull(producer, "p-abort2")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND, error
        return engine_idle(producer.address)

    wait_until(settled, 10, "the producer's blocks freed", interval=0.2)


def test_an_unpulled_lease_expires(llama_dir: Path) -> None:
    core = EngineCore(_config(llama_dir, KVTransferConfig(kv_role="kv_producer", kv_lease_duration_s=0.3)))
    _, _, end = _run(core, EngineCoreRequest(
        request_id="p", prompt_token_ids=PROMPT, sampling_params=EngineSamplingParams(max_tokens=1, temperature=0),
        kv_transfer_params=KvTransferParams(do_remote_decode=True)))
    assert end.kv_transfer_params is not None and core.scheduler.kv.num_free_blocks == NUM_BLOCKS - 5
    assert not core.has_work()
    time.sleep(0.35)
    assert core.has_work()  # the busy loop steps once the lease has expired
    core.step()
    assert _all_free(core)
    leases = core.kv_connector.leases  # type: ignore[union-attr]
    assert leases is not None and (leases.num_expired, len(leases)) == (1, 0)
    core.shutdown()


def test_a_request_that_stops_keeps_nothing(llama_dir: Path, unified: EngineCore) -> None:
    want, _, _ = _run(unified, EngineCoreRequest(request_id="u-stop", prompt_token_ids=PROMPT,
                                                 sampling_params=EngineSamplingParams(**GREEDY)))
    core = EngineCore(_config(llama_dir, KVTransferConfig(kv_role="kv_producer")))
    _, _, end = _run(core, EngineCoreRequest(
        request_id="p", prompt_token_ids=PROMPT, eos_token_ids=[want[0]],
        sampling_params=EngineSamplingParams(max_tokens=1, temperature=0),
        kv_transfer_params=KvTransferParams(do_remote_decode=True)))
    assert end.finish_reason == 1 and end.kv_transfer_params is None and _all_free(core)  # STOP: no decode follows
    core.shutdown()


def _pull(producer: ServerThread, request_id: str, layout: epb.KvCacheLayout | None = None) -> int:
    """Pull (and drop) what the producer keeps for `request_id`; the bytes received."""
    if layout is None:
        layout = layout_to_pb(producer.server.servicer.core.kv_connector.layout)  # type: ignore[union-attr]
    with producer.channel() as channel:
        chunks = epb_grpc.EngineCoreServiceStub(channel).PullKvBlocks(
            epb.PullKvBlocksRequest(request_id=request_id, layout=layout), timeout=10)
        return sum(len(c.data) for c in chunks)


def test_a_corrupted_transfer_is_refused_and_recomputed(producer: ServerThread, unified: EngineCore,
                                                        llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer checks each span's CRC-32 the producer sends against the bytes it got: a flipped byte
    in transit (here: in the producer's span after it summed it) is a failed pull, recomputed."""
    check_corrupted_pull_is_recomputed(producer, unified, llama_dir, monkeypatch, "corrupt")


def check_corrupted_pull_is_recomputed(producer: ServerThread, unified: EngineCore, model: Path,
                                       monkeypatch: pytest.MonkeyPatch, tag: str) -> None:
    """A bit of the producer's first span flipped after it summed it: the consumer's pull fails its
    CRC-32 check and the request is recomputed, exactly; the producer's lease ends."""
    from engine_svc.kv_transfer.source import PullSource

    real, real_pieces = PullSource.__iter__, PullSource.pieces

    def corrupted(self: PullSource) -> Iterator[bytes | memoryview]:
        for index, span in enumerate(real(self)):
            if index == 0:
                flipped = bytearray(span)
                flipped[len(flipped) // 2] ^= 0x01
                yield flipped
            else:
                yield span

    def corrupted_pieces(self: PullSource) -> Iterator[list[memoryview]]:
        """The side channel's spans, views of the cache when it sends from there: a copy of the first span's
        middle buffer goes out flipped (the cache itself, and what the producer sums, stay as they are)."""
        for index, views in enumerate(real_pieces(self)):
            if index == 0:
                views = list(views)
                flipped = bytearray(views[len(views) // 2])
                flipped[len(flipped) // 2] ^= 0x01
                views[len(views) // 2] = memoryview(flipped)
            yield views

    monkeypatch.setattr(PullSource, "__iter__", corrupted)
    monkeypatch.setattr(PullSource, "pieces", corrupted_pieces)
    want, _, _ = _run(unified, EngineCoreRequest(request_id=f"u-{tag}", prompt_token_ids=PROMPT,
                                                 sampling_params=EngineSamplingParams(**GREEDY)))
    first = _prefill(producer, f"p-{tag}", PROMPT, GREEDY)
    consumer = _consumer(model)
    try:
        rest, _, _ = _run(consumer, _decode_request(f"d-{tag}", PROMPT, GREEDY, first))
        assert list(first.new_token_ids) + rest == want
        pulled = consumer.kv_connector
        assert pulled is not None and (pulled.num_pull_failures, pulled.num_blocks_pulled) == (1, 0)
    finally:
        consumer.shutdown()
    wait_until(lambda: engine_idle(producer.address), 15, "the producer's blocks freed")


def test_pulls_present_the_engine_token(llama_dir: Path, unified: EngineCore, tmp_path: Path) -> None:
    """A producer started with an engine token answers a pull without it UNAUTHENTICATED (the consumer
    recomputes); a consumer given the same token file (what the server passes it) pulls."""
    from engine_svc.kv_transfer.setup import advertise
    from shared_runtime.security.auth import KeySet

    token_file = tmp_path / "engine-token"
    token_file.write_text("s3cret-engine-token\n")
    config = _config(llama_dir, KVTransferConfig(kv_role="kv_producer"))
    server = ServerThread(EngineServer(config, host="127.0.0.1", port=0,
                                       tokens=KeySet(files=[str(token_file)], name="engine token"))).start()
    try:
        wait_until(lambda: server.server.servicer is not None and server.server.servicer.core is not None, 60,
                   "producer up")
        want, _, _ = _run(unified, EngineCoreRequest(request_id="u-auth", prompt_token_ids=PROMPT,
                                                     sampling_params=EngineSamplingParams(**GREEDY)))
        for rid, token in (("anonymous", None), ("with-token", str(token_file))):
            core = server.server.servicer.core  # type: ignore[union-attr]
            first_out = _prefill(server, f"p-{rid}", PROMPT, GREEDY, token="s3cret-engine-token")
            consumer = _consumer(llama_dir)
            assert consumer.kv_connector is not None
            advertise(consumer.kv_connector, "consumer", "127.0.0.1", 0, token)
            rest, _, _ = _run(consumer, _decode_request(f"d-{rid}", PROMPT, GREEDY, first_out))
            assert list(first_out.new_token_ids) + rest == want
            pulled = (consumer.kv_connector.num_pull_failures, consumer.kv_connector.num_blocks_pulled)
            assert pulled == ((1, 0) if token is None else (0, 5)), rid
            consumer.shutdown()
            if token is None:  # the refused pull never reached the lease: abort it
                core.kv_connector.release([f"p-{rid}"])  # type: ignore[union-attr]
    finally:
        server.begin_drain()
        server.join(15)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                            "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Adds `authorization: Bearer <token>` to a sync channel's Connect calls."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        metadata = [*(details.metadata or ()), self.header]
        return continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials,
                                         details.wait_for_ready, details.compression), request_iterator)


def test_the_engine_flags_parse_and_refuse_by_name(llama_dir: Path) -> None:
    import argparse

    from engine_svc.config import ConfigError, add_engine_args, config_from_args

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)

    def config(*flags: str) -> EngineConfig:
        return config_from_args(parser.parse_args(["--model", str(llama_dir), "--device", "cpu", *flags]))

    kv = config("--kv-transfer-config", '{"kv_connector": "GrpcConnector", "kv_role": "kv_consumer", '
                                        '"kv_load_failure_policy": "fail"}').kv_transfer_config
    assert kv is not None and (kv.kv_role, kv.kv_load_failure_policy, kv.is_producer) == ("kv_consumer", "fail", False)
    short = config("--kv-role", "prefill").kv_transfer_config
    assert short is not None and short.kv_role == "kv_producer" and short.kv_lease_duration_s == 60
    assert config().kv_transfer_config is None
    for bad, says in (('{"kv_role": "kv_sideways"}', "kv_transfer_config.kv_role: 'kv_sideways' is not one of"),
                      ('{"kv_lease": 5}', "unknown key(s) kv_lease"),
                      ('{"kv_lease_duration_s": "long"}', 'kv_transfer_config.kv_lease_duration_s: expected float'),
                      ("[1]", "must be a JSON object")):
        with pytest.raises(argparse.ArgumentError, match=re.escape(says)):
            parser.parse_args(["--model", "m", "--kv-transfer-config", bad])
    with pytest.raises(ConfigError, match="contradicts"):
        config("--kv-role", "decode", "--kv-transfer-config", '{"kv_role": "kv_producer"}')
    assert config("--kv-role", "both", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2").world_size == 4
    ray_config = config("--kv-role", "both", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    assert ray_config.executor_backend == "ray" and ray_config.kv_transfer_config is not None  # P/D on Ray
    assert config("--kv-role", "both", "--tensor-parallel-size", "2", "--nnodes", "2",
                  "--master-port", "29555").kv_transfer_config is not None  # P/D across nodes


def test_a_lease_ends_exactly_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease table alone, on a fake clock: pulled, released (also while pulling) or expired (never while
    pulling), each lease's request comes back from `take_ended` exactly once."""
    from engine_svc.kv_transfer import leases as leases_module
    from engine_svc.kv_transfer.leases import LeaseTable
    from engine_svc.request import Request

    now = [100.0]
    monkeypatch.setattr(leases_module.time, "monotonic", lambda: now[0])
    woken: list[int] = []
    table = LeaseTable(10.0, on_ended=lambda: woken.append(1))
    requests = {rid: Request(EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                               sampling_params=EngineSamplingParams()), 64) for rid in "abcde"}
    for rid in "abcde":
        table.hold(requests[rid], [ord(rid)], 3)
        now[0] += 1.0  # a at 110, b at 111, ...
    assert table.begin_pull("a") is not None and table.begin_pull("a") is None  # pulled at most once
    assert table.begin_pull("b") is not None
    assert table.release("b") and table.release("c") and not table.release("zz")
    assert [r.request_id for r in table.take_ended()] == ["c"]  # b ends when its pull does
    now[0] = 113.5  # a (pulling), b (pulling), d (112) past their end
    assert table.has_ended()
    assert [r.request_id for r in table.take_ended()] == ["d"]
    assert table.begin_pull("e") is not None and table.begin_pull("d") is None
    for rid in "abe":
        table.end_pull(rid)
    assert [r.request_id for r in table.take_ended()] == ["a", "b", "e"] and len(woken) == 3
    assert not table.has_ended() and table.take_ended() == [] and len(table) == 0
    assert (table.num_pulled, table.num_released, table.num_expired) == (3, 1, 1)


def test_lora_requests_pull_only_kv_computed_under_their_adapter(llama_dir: Path, tmp_path: Path) -> None:
    """K/V computed under an adapter moves to a consumer serving the same adapter (exact against one engine
    with it); a pull for a request under another adapter (here: the base model) is refused by the producer,
    naming lora_name, and the consumer recomputes it (exact against the base model)."""
    from tests.engine.lora_support import ALL_MODULES, make_adapter

    adapter = make_adapter(llama_dir, tmp_path / "sql", rank=8, alpha=16, targets=ALL_MODULES, seed=5)
    lora = {"enable_lora": True, "lora_modules": {"sql": str(adapter)}, "max_lora_rank": 8}
    server = ServerThread(EngineServer(_config(llama_dir, KVTransferConfig(kv_role="kv_producer"), **lora),
                                       host="127.0.0.1", port=0)).start()
    wait_until(lambda: engine_idle(server.address), 60, "producer up", retry_on=(grpc.RpcError,))
    unified = EngineCore(_config(llama_dir, **lora))
    consumer = EngineCore(_config(llama_dir, KVTransferConfig(kv_role="kv_consumer", kv_pull_timeout_s=10), **lora))
    try:
        for name in ("sql", ""):
            first = _prefill(server, f"p-{name}", PROMPT, GREEDY, lora_name="sql")  # always under the adapter
            # The oracle: the same continuation (after the adapter's first token) on one engine, under `name`.
            want, want_logprobs, _ = _run(unified, EngineCoreRequest(
                request_id=f"u-{name}", prompt_token_ids=PROMPT, sampling_params=EngineSamplingParams(**GREEDY),
                output_token_ids=list(first.new_token_ids), lora_name=name))
            decode = msgspec.structs.replace(_decode_request(f"d-{name}", PROMPT, GREEDY, first), lora_name=name)
            rest, rest_logprobs, _ = _run(consumer, decode)  # "": the adapter's K/V is refused, recomputed
            assert rest == want
            assert [e.logprob for e in rest_logprobs] == pytest.approx([e.logprob for e in want_logprobs], abs=1e-5)
        connector = consumer.kv_connector
        assert connector is not None and connector.num_blocks_pulled == 5 and connector.num_pull_failures == 1
        wait_until(lambda: engine_idle(server.address), 15, "the producer's blocks freed")
        assert _all_free(consumer)
    finally:
        consumer.shutdown()
        server.begin_drain()
        assert server.join(15) == 0
