"""`Run`: one OpenAI request's generations, from admission to close, on the shared generation path.

A request has one prompt (chat, most completions) or a batch of prompts (completions with a list): each
prompt is one `Generation` from `FrontendServer.open_generation`, with its own telemetry call. `start`
admits every prompt first (all or none: a later refusal closes the earlier ones), then prepares and
submits them concurrently (tokenization runs on the frontend's pool, off the event loop).
`batches()` yields `(prompt_index, deltas)`; with several prompts their streams are merged through a
small bounded queue, so a slow client makes each `Generation` merge its deltas instead of queueing them
here. `close()` is idempotent and aborts whatever is unfinished; the telemetry call of each prompt ends
exactly once (`succeed`, or `fail` with the status it ended with; a client that went away is CANCELLED).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from frontend_svc.generation import Generation, GenerationBackend
from frontend_svc.grpc_api.status import code_from_number
from frontend_svc.openai.errors import ApiError, FieldNames, service_error
from frontend_svc.outputs import CompletionDelta
from frontend_svc.processor import PreparedRequest, Prompt, PromptOptions
from frontend_svc.service_error import ServiceError
from frontend_svc.telemetry.call import GenerateCall
from shared_runtime.contract import KvTransferParams, SamplingParams
from shared_runtime.violations import ValidationError


def code_name(code: int) -> str:
    """The gRPC status name of a status number (the name telemetry records)."""
    return str(code_from_number(code).name)


def from_service(exc: ServiceError) -> ApiError:
    return service_error(exc.code, exc.message, exc.reason)


def api_error(exc: ValidationError | ServiceError, names: FieldNames) -> ApiError:
    return names.error(exc) if isinstance(exc, ValidationError) else from_service(exc)


class Run:
    """The generations of one OpenAI request (one per prompt)."""

    def __init__(self, frontend: GenerationBackend, headers: Sequence[tuple[str, str]], route: str,
                 prompts: Sequence[Prompt], params: SamplingParams, request_id: str, priority: int,
                 names: FieldNames, options: PromptOptions | None = None, lora_name: str = "",
                 kv_transfer_params: KvTransferParams | None = None) -> None:
        self._frontend = frontend
        self._lora_name = lora_name  # the LoRA adapter every prompt runs under ("" = the base model)
        self._kv_transfer_params = kv_transfer_params  # P/D driven by the client (openai/kv_transfer.py)
        self._headers = list(headers)
        self._route = route
        self._prompts = list(prompts)
        self._params = params
        self._request_id = request_id
        self._priority = priority
        self._names = names
        self._options = options
        self._calls: list[GenerateCall] = []
        self._generations: list[Generation] = []
        self.prepared: list[PreparedRequest] = []  # after `start`: each prompt's, in order

    async def start(self) -> None:
        """Admit, prepare and submit every prompt; raises ApiError (everything opened is closed then)."""
        f = self._frontend
        try:
            for _ in self._prompts:
                call = f.begin_call(self._headers, f"POST {self._route}",
                                    {"http.request.method": "POST", "http.route": self._route})
                self._calls.append(call)
                self._generations.append(f.open_generation(self._params.n, call))
            self.prepared = list(await asyncio.gather(*(g.start(self._prepare(prompt))
                                                        for g, prompt in zip(self._generations, self._prompts))))
        except (ValidationError, ServiceError) as exc:
            error = api_error(exc, self._names)
            self.fail(code_name(exc.code) if isinstance(exc, ServiceError) else "INVALID_ARGUMENT", error.message)
            self.close()
            try:
                raise error from None
            finally:
                del error  # a local holding the exception raised through this frame would be a cycle
        except asyncio.CancelledError:
            self.fail("CANCELLED", "the client went away")
            self.close()
            raise
        except BaseException as exc:
            self.fail("INTERNAL", f"the request could not be started: {type(exc).__name__}")
            self.close()
            raise

    def _prepare(self, prompt: Prompt) -> Callable[[], PreparedRequest]:
        process, params, request_id, priority, options = self._frontend.process, self._params, \
            self._request_id, self._priority, self._options
        lora_name, kv_transfer_params = self._lora_name, self._kv_transfer_params

        def prepare() -> PreparedRequest:
            prepared = process(prompt, params, request_id=request_id, priority=priority, options=options)
            prepared.lora_name = lora_name
            prepared.kv_transfer_params = kv_transfer_params
            return prepared
        return prepare

    async def batches(self) -> AsyncIterator[tuple[int, list[CompletionDelta]]]:
        """(prompt index, deltas) until every completion finished; raises ServiceError from the engine."""
        if len(self._generations) == 1:
            async for batch in self._generations[0].batches():
                yield 0, batch
            return
        queue: asyncio.Queue[tuple[int, list[CompletionDelta]] | BaseException | None] = asyncio.Queue(
            maxsize=len(self._generations))

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for batch in generation.batches():
                    await queue.put((index, batch))
                await queue.put(None)
            except Exception as exc:
                await queue.put(exc)

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self._generations)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    try:
                        raise item
                    finally:
                        del item  # no cycle through this frame (see raise_if)
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)  # their ends, without their exceptions

    def write_directly(self, write: Callable[[CompletionDelta], bool]) -> None:
        """A single prompt's deltas may be written by `write` while `batches()`'s reader waits
        (`Generation.write_directly`); with several prompts nothing changes (their deltas are merged
        through tasks of their own)."""
        if len(self._generations) == 1:
            self._generations[0].write_directly(write)

    async def collect(self, add: Callable[[int, CompletionDelta], object]) -> None:
        """Every delta, in order, into `add(prompt_index, delta)`; the run then succeeds. An engine failure
        fails the run and is raised as the API's error (`from_service`)."""
        try:
            async for prompt_index, batch in self.batches():
                for delta in batch:
                    add(prompt_index, delta)
        except ServiceError as exc:
            self.fail(code_name(exc.code), exc.message)
            raise from_service(exc) from None
        self.succeed()

    def succeed(self) -> None:
        for call in self._calls:
            call.succeed()

    def fail(self, code: str, message: str) -> None:
        """Each prompt's telemetry call ends once: after `succeed` or an earlier `fail` this is a no-op."""
        for call in self._calls:
            call.fail(code, message)

    def close(self) -> None:
        """Abort what is unfinished and give the admission slots back (idempotent)."""
        self.fail("CANCELLED", "the client went away before the response was complete")
        for generation in self._generations:
            generation.close()
