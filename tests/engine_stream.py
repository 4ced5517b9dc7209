"""Test clients for the engine service (`tandem.engine.v1.EngineCoreService`), in process or over a socket.

- `EngineStream`: one `Connect` call; `add`/`abort` send inputs, a reader thread keeps every output
  message (with its scheduler stats) in `messages`, and when it came in `arrivals`.
- `StepWitness`: a request of its own that decodes one token per engine step. Its stream is a clock
  measured in engine steps, and its messages carry the engine's stats at each step, so a test can count
  the steps between "I closed / cancelled / killed it" and "the engine no longer runs it", and compare
  that with the steps those requests would have needed to end on their own. No test then depends on how
  fast the machine is.
- `engine_load(address)`, `engine_idle(address)`: GetLoad, and "nothing running or waiting, no block in use".
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from tests.support import RPC_TIMEOUT_S

Stats = epb.SchedulerStats


class EngineStream:
    """One `Connect` call: `add`/`abort` send inputs; every output message is kept in `messages`."""

    def __init__(self, channel: grpc.Channel, timeout: float = RPC_TIMEOUT_S * 5) -> None:
        self._inputs: queue.SimpleQueue[epb.EngineCoreInput | None] = queue.SimpleQueue()
        self.call = epb_grpc.EngineCoreServiceStub(channel).Connect(iter(self._inputs.get, None), timeout=timeout)
        self.messages: list[epb.EngineCoreOutputs] = []
        self.arrivals: list[float] = []  # monotonic time of each message (stall tests)
        self.error: grpc.RpcError | None = None
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self.call:
                with self._changed:
                    self.arrivals.append(time.monotonic())
                    self.messages.append(message)
                    self._changed.notify_all()
        except grpc.RpcError as error:
            with self._changed:
                self.error = error
                self._changed.notify_all()

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8, **params: Any) -> None:
        sampling = epb.EngineSamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
        self.send(epb.EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling))

    def send(self, request: epb.EngineCoreRequest) -> None:
        self._inputs.put(epb.EngineCoreInput(add=request))

    def abort(self, *request_ids: str) -> None:
        self._inputs.put(epb.EngineCoreInput(abort=epb.AbortRequests(request_ids=list(request_ids))))

    def close(self) -> None:
        self.call.cancel()
        self._inputs.put(None)

    def outputs(self, request_id: str | None = None) -> list[epb.EngineCoreOutput]:
        with self._changed:
            return [o for m in self.messages for o in m.outputs if request_id in (None, o.request_id)]

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs(request_id) for t in o.new_token_ids]

    def last(self, request_id: str) -> epb.EngineCoreOutput | None:
        """The request's final output (finish_reason set), or None while it runs."""
        ends = [o for o in self.outputs(request_id) if o.finish_reason]
        return ends[-1] if ends else None

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "outputs") -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: predicate() or self.error is not None, timeout), \
                f"{what} not seen within {timeout}s"
            assert predicate(), f"the stream failed before {what}: {self.error}"

    def wait_finished(self, *request_ids: str, timeout: float = 10.0) -> None:
        self.wait(lambda: all(self.last(r) is not None for r in request_ids), timeout, f"{request_ids} finished")


class StepWitness:
    """A request on its own stream, long enough to outlive the test, that counts engine steps."""

    def __init__(self, channel: grpc.Channel, prompt: list[int], max_tokens: int) -> None:
        self.request_id = f"witness-{uuid.uuid4().hex[:8]}"
        self.stream = EngineStream(channel)
        self.stream.add(self.request_id, prompt, max_tokens=max_tokens)
        self.stream.wait(lambda: bool(self.stream.tokens(self.request_id)), what="the witness's first token")

    def stats(self) -> Stats:
        """The engine's stats at the latest step the witness has heard of."""
        with self.stream._changed:
            return self.stream.messages[-1].scheduler_stats

    def wait_stats(self, predicate: Callable[[Stats], bool], what: str, timeout: float = 30.0) -> None:
        self.stream.wait(lambda: predicate(self.stats()), timeout, what)

    def mark(self) -> tuple[int, int]:
        """Now, as (messages seen, steps seen): no later step has happened before it."""
        with self.stream._changed:
            return len(self.stream.messages), len(self.stream.tokens(self.request_id))

    def steps_until(self, since: tuple[int, int], predicate: Callable[[Stats], bool], what: str,
                    within_steps: int, timeout: float = 60.0) -> int:
        """The engine steps from `since` to the first step whose stats satisfy `predicate` (an upper bound:
        steps coalesced into one message count as one position). Fails once the witness has counted
        `within_steps` steps without seeing it, so a test fails as fast as the engine steps, not at a
        timeout."""
        first_message, steps_before = since
        found: list[int] = []

        def done() -> bool:
            steps = steps_before
            for message in self.stream.messages[first_message:]:
                steps += sum(len(o.new_token_ids) for o in message.outputs if o.request_id == self.request_id)
                if predicate(message.scheduler_stats):
                    found.append(steps - steps_before)
                    return True
            return steps - steps_before > within_steps

        self.stream.wait(done, timeout, what)
        assert found, f"{what}: not within {within_steps} engine steps"
        assert self.stream.last(self.request_id) is None, "the witness ended: it cannot count steps any more"
        return found[0]

    def stop(self) -> None:
        self.stream.abort(self.request_id)
        self.stream.wait_finished(self.request_id)
        self.stream.close()


def engine_load(address: str) -> epb.EngineLoad:
    with grpc.insecure_channel(address) as channel:
        return epb_grpc.EngineCoreServiceStub(channel).GetLoad(epb.GetLoadRequest(), timeout=5)


def engine_idle(address: str) -> bool:
    """Nothing running or waiting, and every KV block free."""
    now = engine_load(address)
    return (now.num_running, now.num_waiting, now.kv_cache_usage) == (0, 0, 0) \
        and now.num_free_blocks == now.num_total_blocks > 0
