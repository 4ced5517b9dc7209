"""The dispatcher's migration against fake engines: a request an engine hands back (an UNAVAILABLE error
after some tokens) continues on the other engine - never on the one that gave it back - as a continuation
carrying the tokens so far, and the client gets exactly what an undisturbed engine would have sent.
The end-to-end behaviour with real engines (kill -9, drains, TP worker deaths) is tests/e2e/test_migration.py."""

from __future__ import annotations

from typing import Any

from tandem.v1 import generation_pb2 as pb

from frontend_svc.client import collect
from frontend_svc.config import FrontendConfig
from frontend_svc.server import FrontendServer
from tests.fake_engine import SEED_ENDLESS, SEED_FAIL_LATE, FakeEngine, start_fake_engine
from tests.support import DeadlineClient, LoopThread, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests in the sun."


def _frontend(loop: LoopThread, tokenizer: Any, model_dir: Any, ports: list[int], **overrides: Any) -> FrontendServer:
    config = FrontendConfig(model=str(model_dir), engines=tuple(f"127.0.0.1:{p}" for p in ports),
                            host="127.0.0.1", port=0, routing="least-load", **overrides)

    async def start() -> FrontendServer:
        server = FrontendServer(config, tokenizer=tokenizer)
        await server.start()
        return server

    return loop.run(start())  # type: ignore[no-any-return]


def test_a_handed_back_request_continues_on_the_other_engine(loop: LoopThread, tokenizer: Any,
                                                              tiny_model_dir: Any) -> None:
    fakes = [FakeEngine(vocab_size=tokenizer.vocab_size), FakeEngine(vocab_size=tokenizer.vocab_size)]
    servers = [loop.run(start_fake_engine(f)) for f in fakes]
    frontend = _frontend(loop, tokenizer, tiny_model_dir, [port for _, port in servers])
    try:
        wait_until(lambda: len(frontend.engines.ready_engines()) == 2)
        with DeadlineClient(f"127.0.0.1:{frontend.bound_port}") as client:
            undisturbed = collect(client.generate(PROMPT, max_tokens=10))[0]
            # Three endless streams load the engines 2 / 1: the request that fails goes to the less loaded
            # one and, once it failed there, that engine is still the less loaded: least-load routing alone
            # would send the continuation right back.
            busy = [client.generate(PROMPT, seed=SEED_ENDLESS) for _ in range(3)]
            for stream in busy:
                next(stream)
            moved = collect(client.generate(PROMPT, max_tokens=10, seed=SEED_FAIL_LATE))[0]
            for stream in busy:
                stream.cancel()
        assert moved["token_ids"] == undisturbed["token_ids"] and len(moved["token_ids"]) == 10
        assert moved["text"] == undisturbed["text"]
        assert moved["finish_reason"] == pb.FINISH_REASON_LENGTH
        assert (moved["usage"].prompt_tokens, moved["usage"].completion_tokens) == (
            undisturbed["usage"].prompt_tokens, 10)
        first, second = sorted(fakes, key=lambda f: -sum(a.sampling_params.seed == SEED_FAIL_LATE
                                                          and not a.output_token_ids for a in f.added))
        continuation = next(a for a in second.added if a.output_token_ids)
        assert list(continuation.output_token_ids) == moved["token_ids"][:2]
        assert continuation.request_id.endswith(".m1")
        assert not any(a.output_token_ids for a in first.added), "it went back to the engine that gave it up"
    finally:
        loop.run(frontend.stop())
        for server, _ in servers:
            loop.run(server.stop(None))


def test_with_migration_off_a_handed_back_request_ends_unavailable(loop: LoopThread, tokenizer: Any,
                                                                    tiny_model_dir: Any) -> None:
    fakes = [FakeEngine(vocab_size=tokenizer.vocab_size), FakeEngine(vocab_size=tokenizer.vocab_size)]
    servers = [loop.run(start_fake_engine(f)) for f in fakes]
    frontend = _frontend(loop, tokenizer, tiny_model_dir, [port for _, port in servers], max_migrations=0)
    try:
        wait_until(lambda: len(frontend.engines.ready_engines()) == 2)
        with DeadlineClient(f"127.0.0.1:{frontend.bound_port}") as client:
            import grpc
            try:
                collect(client.generate(PROMPT, max_tokens=10, seed=SEED_FAIL_LATE))
                raise AssertionError("the request should have failed")
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert not any(a.output_token_ids for f in fakes for a in f.added)
    finally:
        loop.run(frontend.stop())
        for server, _ in servers:
            loop.run(server.stop(None))
