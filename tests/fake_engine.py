"""A fake `EngineCoreService` for frontend tests (and bench/frontend_capacity.py) that need no model and no torch.

It echoes each request's prompt tokens back (or, when given, cycles through `output_ids` instead), one per
step (every `step_s`; 0 = as fast as the stream takes them), until `max_tokens`, or, when the request
leaves max_tokens unset, `default_max_tokens` (None: forever). A request that asks for logprobs gets a
made-up entry per token (the token at rank 1, then the next top-N ids). A stream that ends aborts what
it added, as the real engine does. The request's sampling seed steers it: `SEED_REJECT` fails the
request at once (RESOURCE_EXHAUSTED), `SEED_FAIL_LATE` sends two tokens then fails it (UNAVAILABLE; a continuation of it, which arrives with
`output_token_ids`, goes on instead),
`SEED_ENDLESS` never finishes. It records what it was sent (`added`, `aborted`), what still runs
(`running`), and the most requests it ever had running at once (`max_running`). Given
`tokenizer_files`, it serves them as GetTokenizer does (the real archive, in small chunks) and announces
their checksum in GetEngineInfo; without, GetTokenizer is NOT_FOUND. It serves no KV cache events.

With `clocked=True` it behaves like the real engine's server at a fixed step time instead: a step is made
every `step_s` whether or not the stream took the previous one, and the steps that queued up while a
message was being written go out together in the next message, in order (engine_svc/api/server.py does the
same), so a frontend that cannot keep up receives several tokens per request per message. With
`catch_up=True` too, a clock tick that comes late (the fake engine's process starved of CPU, which a real
engine's device never is) makes every step it owes at once, so the engine offers one step per `step_s`
of wall time whatever the load on its core.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from shared_runtime import tokenizer_bundle

SEED_REJECT, SEED_FAIL_LATE, SEED_ENDLESS = 911, 912, 913
IDLE_POLL_S = 0.001  # how often a stream with nothing running looks for new requests when step_s = 0


class FakeEngine(epb_grpc.EngineCoreServiceServicer):
    def __init__(self, vocab_size: int, max_model_len: int = 256, step_s: float = 0.004,
                 default_max_tokens: int | None = 8, output_ids: list[int] | None = None,
                 tokenizer_files: dict[str, bytes] | None = None, model_name: str = "fake",
                 clocked: bool = False, catch_up: bool = False) -> None:
        self.vocab_size, self.max_model_len, self.step_s = vocab_size, max_model_len, step_s
        self.clocked, self.catch_up = clocked, catch_up
        self.messages = 0  # EngineCoreOutputs messages sent, over all streams
        self.model_name = model_name
        self.archive = tokenizer_bundle.pack(tokenizer_files) if tokenizer_files is not None else None
        self.default_max_tokens = default_max_tokens
        self.output_ids = output_ids
        self.stop_on_eos = False  # True: a token in the request's eos_token_ids ends it (STOP), as the real engine
        self.added: list[epb.EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.running: dict[str, list[Any]] = {}  # request id -> [request, tokens produced]
        self.max_running = 0
        self.kv_role = ""  # EngineInfo.kv_role; a producer's LENGTH finish of a do_remote_decode request names its blocks

    async def GetEngineInfo(self, request: Any, context: Any) -> epb.EngineInfo:
        sha256 = tokenizer_bundle.sha256_hex(self.archive) if self.archive is not None else ""
        return epb.EngineInfo(model_name=self.model_name, max_model_len=self.max_model_len,
                              vocab_size=self.vocab_size, block_size=16, engine_id="fake-engine",
                              tokenizer_sha256=sha256, kv_role=self.kv_role)

    async def GetTokenizer(self, request: Any, context: Any) -> Any:
        archive = self.archive
        if archive is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "the fake engine has no tokenizer")
            return
        size = 64 * 1024
        for start in range(0, len(archive), size):
            first, last = start == 0, start + size >= len(archive)
            yield epb.TokenizerChunk(data=archive[start:start + size], model_name=self.model_name if first else "",
                                     total_size=len(archive) if first else 0,
                                     sha256=tokenizer_bundle.sha256_hex(archive) if last else "")

    async def GetLoad(self, request: Any, context: Any) -> epb.EngineLoad:
        return epb.EngineLoad(num_running=len(self.running))

    async def Connect(self, request_iterator: Any, context: Any) -> Any:
        mine: set[str] = set()
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(request_iterator, mine))
        queued: list[epb.EngineCoreOutput] = []  # clocked: steps made but not yet sent
        made = asyncio.Event()
        clock = loop.create_task(self._clock(mine, queued, made)) if self.clocked else None
        try:
            while True:
                if clock is not None:
                    await made.wait()
                    made.clear()
                    outputs, queued[:] = list(queued), []
                else:
                    await asyncio.sleep(self.step_s if mine else max(self.step_s, IDLE_POLL_S))  # idle: no spinning
                    outputs = self._steps(mine)
                if outputs:
                    self.messages += 1
                    yield epb.EngineCoreOutputs(outputs=outputs, scheduler_stats=epb.SchedulerStats(
                        num_running=len(self.running)))
        finally:
            reader.cancel()
            if clock is not None:
                clock.cancel()
            for rid in mine:  # the stream ended: abort what it added, as the real engine does
                self.running.pop(rid, None)

    def _steps(self, mine: set[str]) -> list[epb.EngineCoreOutput]:
        """One step of every request this stream runs; finished ones stop running."""
        outputs = [self._step(rid) for rid in sorted(mine) if rid in self.running]
        for out in outputs:
            if out.finish_reason:
                mine.discard(out.request_id)
                del self.running[out.request_id]
        return outputs

    async def _clock(self, mine: set[str], queued: list[epb.EngineCoreOutput], made: asyncio.Event) -> None:
        """`clocked`: a step every `step_s` (on schedule; a late step does not push the next ones back),
        appended to what the stream has not sent yet."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if self.catch_up and mine:
                due += self.step_s
            else:  # after a stall: no burst of catch-up steps
                due = max(due + self.step_s, loop.time() - self.step_s)
            await asyncio.sleep(max(0.0, due - loop.time()) if mine else max(self.step_s, IDLE_POLL_S))
            owed = 1
            if self.catch_up:
                owed += max(0, int((loop.time() - due) / self.step_s))
                due += (owed - 1) * self.step_s
            for _ in range(owed):
                outputs = self._steps(mine)
                if not outputs:
                    break
                queued.extend(outputs)
                made.set()

    async def _read(self, request_iterator: Any, mine: set[str]) -> None:
        async for message in request_iterator:
            if message.WhichOneof("kind") == "add":
                self.added.append(message.add)
                # A continuation goes on from the tokens it already has (as the real engine counts them).
                self.running[message.add.request_id] = [message.add, len(message.add.output_token_ids)]
                mine.add(message.add.request_id)
                self.max_running = max(self.max_running, len(self.running))
            else:
                for rid in message.abort.request_ids:
                    self.aborted.append(rid)
                    self.running.pop(rid, None)
                    mine.discard(rid)

    def _step(self, rid: str) -> epb.EngineCoreOutput:
        request, produced = self.running[rid]
        sp = request.sampling_params
        seed = sp.seed if sp.HasField("seed") else None
        late = seed == SEED_FAIL_LATE and produced == 2 and not request.output_token_ids
        if seed == SEED_REJECT or late:
            code = epb.ERROR_CODE_RESOURCE_EXHAUSTED if seed == SEED_REJECT else epb.ERROR_CODE_UNAVAILABLE
            return epb.EngineCoreOutput(request_id=rid, finish_reason=epb.FINISH_REASON_ERROR,
                                        error=epb.EngineError(code=code, message="fake engine says no"))
        source = self.output_ids or request.prompt_token_ids
        token = source[produced % len(source)]
        self.running[rid][1] = produced = produced + 1
        out = epb.EngineCoreOutput(request_id=rid, new_token_ids=[token])
        if sp.HasField("logprobs"):
            top = [(token + k) % self.vocab_size for k in range(sp.logprobs)]
            out.new_logprobs.add(token_id=token, logprob=-0.5, rank=1, top_token_ids=top,
                                 top_logprobs=[-0.5 - k for k in range(len(top))])
        limit = sp.max_tokens if sp.HasField("max_tokens") else self.default_max_tokens
        if token in sp.stop_token_ids:
            out.finish_reason, out.stop_token_id = epb.FINISH_REASON_STOP, token
        elif self.stop_on_eos and token in request.eos_token_ids and not sp.ignore_eos:
            out.finish_reason = epb.FINISH_REASON_STOP
        elif limit is not None and produced >= limit and seed != SEED_ENDLESS:
            out.finish_reason = epb.FINISH_REASON_LENGTH
            if self.kv_role and request.kv_transfer_params.do_remote_decode:
                out.kv_transfer_params.remote_request_id = rid
                out.kv_transfer_params.remote_host = "fake-producer"
                out.kv_transfer_params.remote_num_tokens = len(request.prompt_token_ids)
        return out


async def start_fake_engine(fake: FakeEngine, port: int = 0,
                            health_servicer: Any = None) -> tuple[grpc.aio.Server, int]:
    """Serve `fake` (and a health servicer, if given) on 127.0.0.1:port; returns the server and its port."""
    server = grpc.aio.server()
    epb_grpc.add_EngineCoreServiceServicer_to_server(fake, server)
    if health_servicer is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound
