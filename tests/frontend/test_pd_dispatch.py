"""The dispatcher's prefill/decode flow (`--routing pd`) against fake engines: a request goes to the
prefill engine (kv_producer) as max_tokens=1 with do_remote_decode, then continues on the decode engine
(kv_consumer) as a continuation after the first token, pulling the kept blocks the prefill named; the
client gets exactly what one engine sends. A request P/D cannot help (max_tokens 1) goes the plain way,
and a completion that ends on its first token releases the kept blocks with an abort.
The end-to-end behaviour with real engines is tests/e2e/test_pd_disaggregation.py."""

from __future__ import annotations

from typing import Any

from tandem.v1 import generation_pb2 as pb

from frontend_svc.client import collect
from frontend_svc.config import FrontendConfig
from frontend_svc.server import FrontendServer
from tests.fake_engine import FakeEngine, start_fake_engine
from tests.support import DeadlineClient, LoopThread, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests in the sun."


def _cluster(loop: LoopThread, tokenizer: Any, model_dir: Any, routing: str = "pd") -> tuple[list[FakeEngine], list[Any], FrontendServer]:
    words = tokenizer.encode(" alpha beta gamma delta", add_special_tokens=False)
    fakes = [FakeEngine(vocab_size=tokenizer.vocab_size, output_ids=words) for _ in range(2)]
    fakes[0].kv_role, fakes[1].kv_role = "kv_producer", "kv_consumer"
    servers = [loop.run(start_fake_engine(f)) for f in fakes]
    config = FrontendConfig(model=str(model_dir), engines=tuple(f"127.0.0.1:{p}" for _, p in servers),
                            host="127.0.0.1", port=0, routing=routing)

    async def start() -> FrontendServer:
        server = FrontendServer(config, tokenizer=tokenizer)
        await server.start()
        return server

    frontend = loop.run(start())
    wait_until(lambda: len(frontend.engines.ready_engines()) == 2)
    return fakes, servers, frontend


def _stop(loop: LoopThread, servers: list[Any], frontend: FrontendServer) -> None:
    loop.run(frontend.stop())
    for server, _ in servers:
        loop.run(server.stop(None))


def test_prefill_then_decode_gives_what_one_engine_gives(loop: LoopThread, tokenizer: Any, tiny_model_dir: Any) -> None:
    (producer, consumer), servers, frontend = _cluster(loop, tokenizer, tiny_model_dir)
    try:
        with DeadlineClient(f"127.0.0.1:{frontend.bound_port}") as client:
            got = collect(client.generate(PROMPT, max_tokens=10))[0]
            one = collect(client.generate(PROMPT, max_tokens=1))[0]
        prefill, = [a for a in producer.added if a.kv_transfer_params.do_remote_decode]
        decode, = [a for a in consumer.added if a.kv_transfer_params.do_remote_prefill]
        assert prefill.sampling_params.max_tokens == 1
        assert list(decode.output_token_ids) == got["token_ids"][:1] and decode.sampling_params.max_tokens == 10
        assert decode.request_id == f"{prefill.request_id}.d"
        kv = decode.kv_transfer_params
        assert kv.do_remote_prefill and not kv.do_remote_decode
        assert (kv.remote_request_id, kv.remote_host) == (prefill.request_id, "fake-producer")
        # What one engine sends: the fake's tokens cycle through its output ids.
        words = list(producer.output_ids or ())
        assert got["token_ids"] == [words[i % len(words)] for i in range(10)]
        assert got["text"] == tokenizer.decode(got["token_ids"]) and got["finish_reason"] == pb.FINISH_REASON_LENGTH
        assert (got["usage"].prompt_tokens, got["usage"].completion_tokens) == (len(prefill.prompt_token_ids), 10)
        # max_tokens=1 gains nothing from P/D: one plain request, kept blocks never asked for.
        plain = [a for a in producer.added + consumer.added if not a.kv_transfer_params.ByteSize()]
        assert len(plain) == 1 and one["token_ids"] == words[:1]
    finally:
        _stop(loop, servers, frontend)


def test_a_completion_that_ends_on_its_first_token_releases_the_kept_blocks(loop: LoopThread, tokenizer: Any,
                                                                           tiny_model_dir: Any) -> None:
    (producer, consumer), servers, frontend = _cluster(loop, tokenizer, tiny_model_dir)
    try:
        with DeadlineClient(f"127.0.0.1:{frontend.bound_port}") as client:
            first_text = collect(client.generate(PROMPT, max_tokens=1))[0]["text"]
            got = collect(client.generate(PROMPT, max_tokens=10, stop=[first_text]))[0]
        assert first_text and got["finish_reason"] == pb.FINISH_REASON_STOP
        prefill = next(a for a in producer.added if a.kv_transfer_params.do_remote_decode)
        wait_until(lambda: prefill.request_id in producer.aborted, 5, "the kept blocks released")
        assert not any(a.kv_transfer_params.do_remote_prefill for a in consumer.added)
    finally:
        _stop(loop, servers, frontend)
