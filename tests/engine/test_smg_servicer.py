"""SMG's `vllm.grpc.engine.VllmEngine` on a real (tiny) engine in process, over gRPC (engine_svc/api/smg/servicer.py).

The reference for every generated token is the same engine's own EngineCoreService (a Connect stream
with the same prompt and params): the two protocols must run the same requests. Checked: streaming
chunks and the final Complete, stream=false, n=2 with `index`, logprobs and prompt logprobs, stop token
ids (`matched_token_id`), stop strings ended in the engine (`matched_stop_str`, fewer tokens computed
than without the stop), Abort and a cancelled call both free the engine, refusals (text input, a bad
value, a full admission queue), the info / load / tokenizer / KV-event RPCs, and UNIMPLEMENTED ones.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tokenizers
from tandem.vendor.smg import common_pb2 as cpb
from tandem.vendor.smg import vllm_engine_pb2 as vpb
from tandem.vendor.smg import vllm_engine_pb2_grpc as vpb_grpc

from engine_svc.api.server import EngineServer
from engine_svc.api.tokenizer_archive import read_tokenizer_archive
from engine_svc.config import EngineConfig
from engine_svc.telemetry import EngineTelemetry
from engine_svc.telemetry.metrics import EngineMetrics
from tests.engine.test_engine_server import ServerThread
from tests.engine_stream import EngineStream, engine_idle, engine_load
from tests.support import wait_until

PROMPT = [5, 17, 33, 101, 7, 250, 12]
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Iterator[ServerThread]:
    config = EngineConfig.create(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=4,
                                 block_size=4, num_gpu_blocks_override=256)
    telemetry = EngineTelemetry(metrics=EngineMetrics("tiny"))  # tokens sampled: what a stop string saved
    running = ServerThread(EngineServer(config, host="127.0.0.1", port=0, max_waiting=2,
                                        telemetry=telemetry)).start()
    wait_until(lambda: engine_idle(running.address), 60, "engine up", retry_on=(grpc.RpcError,))
    yield running
    running.begin_drain()
    assert running.join(15) == 0


@pytest.fixture(scope="module")
def stub(engine: ServerThread) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(engine.channel())


def request(request_id: str, *, stream: bool = True, prompt: list[int] = PROMPT,
            **sampling: object) -> vpb.GenerateRequest:
    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **sampling}
    return vpb.GenerateRequest(request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=prompt),
                               sampling_params=vpb.SamplingParams(**params), stream=stream)


def reference(engine: ServerThread, max_tokens: int = 8, prompt: list[int] = PROMPT, **params: object) -> list[int]:
    """The tokens the engine's own protocol generates for the same request."""
    stream = EngineStream(engine.channel())
    try:
        stream.add("ref", prompt, max_tokens=max_tokens, **params)  # greedy, ignore_eos
        stream.wait_finished("ref", timeout=TIMEOUT)
        return stream.tokens("ref")
    finally:
        stream.close()


def test_streaming_generate_sends_each_step_then_one_complete(engine: ServerThread,
                                                              stub: vpb_grpc.VllmEngineStub) -> None:
    expected = reference(engine)
    responses = list(stub.Generate(request("s1"), timeout=TIMEOUT))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    completes = [r.complete for r in responses if r.HasField("complete")]
    assert len(completes) == 1 and responses[-1].HasField("complete")
    assert [t for ch in chunks for t in ch.token_ids] == expected
    assert all(ch.prompt_tokens == len(PROMPT) and ch.completion_tokens == len(ch.token_ids) for ch in chunks)
    done = completes[0]
    assert done.finish_reason == "length" and done.prompt_tokens == len(PROMPT)
    assert list(done.output_ids) == list(chunks[-1].token_ids)  # the last delta, as vLLM's servicer sends it
    assert done.WhichOneof("matched_stop") is None


def test_non_streaming_generate_answers_one_complete_with_every_token(engine: ServerThread,
                                                                      stub: vpb_grpc.VllmEngineStub) -> None:
    expected = reference(engine)
    (only,) = list(stub.Generate(request("ns1", stream=False), timeout=TIMEOUT))
    assert list(only.complete.output_ids) == expected and only.complete.completion_tokens == len(expected)
    assert only.complete.finish_reason == "length"


def test_n_samples_fan_out_with_their_index(engine: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    responses = list(stub.Generate(request("n2", stream=False, n=2, temperature=1.0, seed=3), timeout=TIMEOUT))
    assert sorted(r.complete.index for r in responses) == [0, 1]
    assert [r.complete.index for r in responses] == [0, 1]
    outs = [list(r.complete.output_ids) for r in responses]
    assert all(len(o) == 8 for o in outs) and outs[0] != outs[1]
    streamed = list(stub.Generate(request("n2s", n=2, temperature=1.0, seed=3), timeout=TIMEOUT))
    by_index: dict[int, list[int]] = {0: [], 1: []}
    for r in streamed:
        if r.HasField("chunk"):
            by_index[r.chunk.index].extend(r.chunk.token_ids)
    assert [by_index[0], by_index[1]] == outs  # the same seeds give the same samples
    assert sorted(r.complete.index for r in streamed if r.HasField("complete")) == [0, 1]


def test_logprobs_and_prompt_logprobs(engine: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    (only,) = list(stub.Generate(request("lp", stream=False, logprobs=2, prompt_logprobs=1), timeout=TIMEOUT))
    done = only.complete
    out = done.output_logprobs
    assert list(out.token_ids) == list(done.output_ids) and len(out.token_logprobs) == 8
    assert all(len(top.token_ids) == 2 and top.values[0] >= top.values[1] for top in out.top_logprobs)
    assert all(top.token_ids[0] == t for top, t in zip(out.top_logprobs, done.output_ids))  # greedy: the best
    assert all(lp <= 0 for lp in out.token_logprobs)
    inp = done.input_logprobs
    assert list(inp.token_ids) == PROMPT and len(inp.token_logprobs) == len(PROMPT)
    assert not inp.token_logprobs[0].HasField("value")
    assert all(e.HasField("value") and e.value <= 0 for e in inp.token_logprobs[1:])
    streamed = list(stub.Generate(request("lps", logprobs=0), timeout=TIMEOUT))
    chunk_lps = [lp for r in streamed if r.HasField("chunk") for lp in r.chunk.output_logprobs.token_logprobs]
    assert chunk_lps == pytest.approx(list(out.token_logprobs), abs=1e-5)
    assert not any(r.chunk.output_logprobs.top_logprobs for r in streamed if r.HasField("chunk"))


def test_a_stop_token_id_is_reported_as_matched(engine: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    expected = reference(engine)
    stop_id = expected[3]
    (only,) = list(stub.Generate(request("st", stream=False, stop_token_ids=[stop_id]), timeout=TIMEOUT))
    cut = expected.index(stop_id) + 1
    assert list(only.complete.output_ids) == expected[:cut]
    assert only.complete.finish_reason == "stop" and only.complete.matched_token_id == stop_id


def test_a_stop_string_ends_the_sample_in_the_engine(engine: ServerThread, stub: vpb_grpc.VllmEngineStub,
                                                     llama_dir: Path) -> None:
    expected = reference(engine, max_tokens=24)
    tok = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    text = tok.decode(expected)
    full = tok.decode(PROMPT + expected)
    prompt_text = tok.decode(PROMPT)
    assert full.startswith(prompt_text)
    generated = full[len(prompt_text):]
    start = len(generated) // 3
    stop = next(generated[i:i + 2] for i in range(start, len(generated) - 1)
                if "\ufffd" not in generated[i:i + 2] and generated[i:i + 2].strip())
    before = generated.index(stop)
    sampled = engine.server.telemetry.metrics.generation_tokens  # type: ignore[union-attr]
    wait_until(lambda: engine_idle(engine.address), 10, "engine idle")
    start = sampled._value.get()
    (only,) = list(stub.Generate(request("ss", stream=False, max_tokens=400, stop=[stop]), timeout=TIMEOUT))
    done = only.complete
    assert done.finish_reason == "stop" and done.matched_stop_str == stop, text
    ids = list(done.output_ids)
    assert ids == expected[:len(ids)] and len(ids) < len(expected) and done.finish_reason == "stop"
    # The sample ended at the token that completed the match, not later.
    assert stop in tok.decode(PROMPT + ids)[len(prompt_text):]
    assert stop not in tok.decode(PROMPT + ids[:-1])[len(prompt_text):][: before + len(stop)]
    wait_until(lambda: engine_idle(engine.address), 10, "the stopped sample freed in the engine")
    assert sampled._value.get() - start <= len(ids) + 2, "the engine kept generating after the stop string"


def test_abort_ends_the_call_with_abort_and_frees_the_engine(engine: ServerThread,
                                                             stub: vpb_grpc.VllmEngineStub) -> None:
    call = stub.Generate(request("ab", max_tokens=500), timeout=TIMEOUT)
    first = next(call)
    assert first.HasField("chunk")
    stub.Abort(vpb.AbortRequest(request_ids=["ab"]), timeout=TIMEOUT)
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    wait_until(lambda: engine_idle(engine.address), 10, "the aborted request freed")


def test_a_cancelled_call_is_aborted_in_the_engine(engine: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    call = stub.Generate(request("cx", max_tokens=500), timeout=TIMEOUT)
    next(call)
    assert engine_load(engine.address).num_running == 1
    call.cancel()
    wait_until(lambda: engine_idle(engine.address), 10, "the cancelled call's request aborted")


def test_refusals_name_the_field(stub: vpb_grpc.VllmEngineStub) -> None:
    for bad, field in ((vpb.GenerateRequest(request_id="t", text="hello"), "text"),
                       (vpb.GenerateRequest(request_id="k", tokenized=vpb.TokenizedInput(input_ids=PROMPT),
                                            kv_transfer_params_json="[1]"), "kv_transfer_params_json"),
                       (request("tp", top_p=3.0), "sampling_params.top_p"),
                       (request("big", prompt=[1] * 100_000), "tokenized.input_ids")):
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(bad, timeout=TIMEOUT))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:  # the engine's own check, past the mapping
        list(stub.Generate(request("voc", prompt=[10_000]), timeout=TIMEOUT))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("method", ["Generate", "GetModelInfo"])
def test_undecodable_bytes_are_invalid_argument_without_exception_text(engine: ServerThread, method: str) -> None:
    """Before: UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>: ..." (grpcio's default)."""
    with engine.channel() as channel:
        call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
            f"/vllm.grpc.engine.VllmEngine/{method}", request_serializer=lambda b: b, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as caught:
            result = call(b"\xff\xff\xff\xff", timeout=TIMEOUT)
            list(result) if method == "Generate" else result
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert caught.value.details() == f"the request is not a valid {method} request message"


def test_the_admission_queue_bound_holds_for_smg_calls(engine: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    """max_num_seqs 4, --max-waiting 2: past 6 live requests the next is RESOURCE_EXHAUSTED."""
    calls = [stub.Generate(request(f"q{i}", max_tokens=500), timeout=TIMEOUT) for i in range(6)]
    try:
        wait_until(lambda: (lambda s: s.num_running + s.num_waiting)(engine_load(engine.address)) == 6, 15,
                   "six requests admitted")
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request("q-extra"), timeout=TIMEOUT))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for call in calls:
            call.cancel()
    wait_until(lambda: engine_idle(engine.address), 15, "every cancelled call freed")


def test_info_load_and_health(engine: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=TIMEOUT).healthy
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=TIMEOUT)
    core = engine.server.servicer.core  # type: ignore[union-attr]
    assert (info.max_context_length, info.vocab_size, info.is_generation) == (core.max_model_len, core.vocab_size, True)
    assert list(info.eos_token_ids) == [1, 4] and info.model_type == "llama"  # tiny_model.py: <|eos|>, <|im_end|>
    server = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert (server.server_type, server.max_num_seqs, server.block_size, server.is_paused) == ("vllm-grpc", 4, 4, False)
    call = stub.Generate(request("load", max_tokens=500), timeout=TIMEOUT)
    next(call)
    wait_until(lambda: stub.GetLoads(vpb.GetLoadsRequest(), timeout=TIMEOUT).loads[0].num_running_reqs == 1, 10,
               "GetLoads counting the running request")
    loads = stub.GetLoads(vpb.GetLoadsRequest(), timeout=TIMEOUT)
    assert loads.dp_rank_count == 1 and 0 < loads.loads[0].token_usage <= 1
    assert loads.loads[0].max_running_requests == 4
    call.cancel()
    wait_until(lambda: stub.GetLoads(vpb.GetLoadsRequest(), timeout=TIMEOUT).loads[0].num_running_reqs == 0, 10,
               "GetLoads back to idle")


def test_get_tokenizer_streams_the_served_archive(stub: vpb_grpc.VllmEngineStub, llama_dir: Path) -> None:
    chunks = list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=TIMEOUT))
    data = b"".join(c.data for c in chunks)
    archive = read_tokenizer_archive(llama_dir)
    assert archive is not None and data == archive.data
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])


def test_kv_events_reach_an_smg_subscriber(engine: ServerThread, stub: vpb_grpc.VllmEngineStub) -> None:
    batches: list[cpb.KvEventBatch] = []
    subscription = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=TIMEOUT)

    def read() -> None:
        try:
            for batch in subscription:
                batches.append(batch)
        except grpc.RpcError:
            pass

    threading.Thread(target=read, daemon=True).start()
    wait_until(lambda: any(b.HasField("snapshot") for b in batches), 10, "the snapshot")
    list(stub.Generate(request("kv", prompt=list(range(40, 52)), max_tokens=2), timeout=TIMEOUT))

    def stored_tokens() -> list[list[int]]:
        return [list(block.token_ids) for b in batches for e in b.events if e.HasField("stored")
                for block in e.stored.blocks]

    wait_until(lambda: [40, 41, 42, 43] in stored_tokens(), 10, "the prompt's blocks stored")
    live = [b.sequence_number for b in batches if not b.HasField("snapshot")]
    assert live == list(range(live[0], live[0] + len(live))), "live batches are numbered without a gap"
    assert batches[0].events[0].HasField("cleared")
    subscription.cancel()


@pytest.mark.parametrize("rpc, message", [("Embed", vpb.EmbedRequest()), ("FlushCache", cpb.FlushCacheRequest()),
                                          ("StartProfile", cpb.StartProfileRequest()),
                                          ("StopProfile", cpb.StopProfileRequest())])
def test_what_tandem_does_not_do_is_unimplemented(stub: vpb_grpc.VllmEngineStub, rpc: str, message: object) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        getattr(stub, rpc)(message, timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
