"""Stream interval (vLLM's `--stream-interval` and per-request `stream_interval`) in the output path.

A completion's first delta and its last go out at once; any other only once >= interval tokens have
accumulated since the last one sent, merged. The concatenation (text, ids, logprobs, finish, usage)
must be what interval 1 gives. The unit tests drive the `OutputProcessor` step by step (exact chunk
sizes); the gRPC tests run a `FrontendServer` with `--stream-interval` in front of the fake engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from entrypoints import serve as serve_cli
from frontend_svc import cli as frontend_cli
from frontend_svc.client import TandemClient
from frontend_svc.config import ConfigError, FrontendConfig
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.outputs import CompletionDelta
from frontend_svc.processor import Processor
from shared_runtime import contract as p
from shared_runtime.contract import SamplingParams
from shared_runtime.to_pb import outputs_to_pb
from shared_runtime.violations import ValidationError
from tests.security.secure_stack import Stack
from tests.support import DeadlineClient, LoopThread, bad_fields, rpc_error

GEN = " the boats rocked against their ropes while a radio played somewhere below deck"
PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests in the sun."


class Outbox:
    """A request's collector as the output processor sees it, read after every step: every delta it is
    handed, in order."""

    def __init__(self) -> None:
        self.deltas: list[CompletionDelta] = []

    def put(self, delta: CompletionDelta) -> CompletionDelta:
        self.deltas.append(delta)
        return delta

    def unread(self, index: int) -> CompletionDelta | None:
        return None  # read after every step

    def of(self, index: int) -> list[CompletionDelta]:
        return [d for d in self.deltas if d.index == index]


@pytest.fixture(scope="module")
def processor(tokenizer: Any) -> Processor:
    return Processor(tokenizer, max_model_len=256, vocab_size=tokenizer.vocab_size, model_name="tiny")


def expected_sizes(total: int, interval: int) -> list[int]:
    """1, interval, interval, ..., the rest: one token per step."""
    rest = (total - 1) % interval
    return [1] + [interval] * ((total - 1) // interval) + ([rest] if rest else [])


def logprob(token: int, i: int) -> p.TokenLogprobs:
    return p.TokenLogprobs(token_id=token, logprob=-0.125 * (i + 1), rank=1 + i % 3,
                           top_token_ids=[token, 9], top_logprobs=[-0.125 * (i + 1), -4.0])


def run(tokenizer: Any, processor: Processor, params: SamplingParams, streams: list[list[list[int]]], *,
        server_interval: int = 1, finish: p.FinishReason = p.FinishReason.LENGTH,
        collector: bool = True) -> tuple[Outbox, list[CompletionDelta]]:
    """Feed one request's completions step by step (`streams[index][step]` = that step's new ids; a
    completion's last step finishes it with `finish`); returns its outbox and the deltas handed back
    (those of a request added without a collector)."""
    op = OutputProcessor(tokenizer, stream_interval=server_interval)
    box = Outbox()
    prepared = processor.process("Mara walked", params)
    op.add_request(prepared, box if collector else None)  # type: ignore[arg-type]
    returned: list[CompletionDelta] = []
    counts = [0] * len(streams)
    for i in range(max(len(s) for s in streams)):
        outputs = []
        for index, steps in enumerate(streams):
            if i >= len(steps):
                continue
            ids = steps[i]
            entries = [logprob(t, counts[index] + k) for k, t in enumerate(ids)] if params.logprobs is not None else []
            counts[index] += len(ids)
            last = i == len(steps) - 1
            outputs.append(p.EngineCoreOutput(request_id=prepared.engine_request_ids[index], new_token_ids=ids,
                                              finish_reason=finish if last else p.FinishReason.UNSPECIFIED,
                                              new_logprobs=entries))
        result = op.process_outputs(outputs_to_pb(p.EngineCoreOutputs(outputs=outputs)))
        returned += result.deltas
    return box, returned


def joined(deltas: list[CompletionDelta]) -> tuple[Any, ...]:
    """What a client ends up with: the concatenation and the last delta's finish fields."""
    lps = [(e.token_id, e.logprob, e.rank, e.top, e.text) for d in deltas for e in (d.logprobs or [])]
    last = deltas[-1]
    usage = (last.usage.prompt_tokens, last.usage.completion_tokens) if last.usage else None
    return ("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], lps,
            last.finish_reason, last.stop_reason, usage, sum(d.finished for d in deltas))


def one_per_step(ids: list[int]) -> list[list[int]]:
    return [[t] for t in ids]


# ---- the output processor ------------------------------------------------------------------------------


@pytest.mark.parametrize("interval", [2, 4, 5, 8])
def test_chunks_carry_1_then_interval_then_the_rest(tokenizer: Any, processor: Processor, encode: Any,
                                                    interval: int) -> None:
    ids = encode(GEN)
    box, _ = run(tokenizer, processor, SamplingParams(max_tokens=100), [one_per_step(ids)],
                 server_interval=interval)
    assert [len(d.token_ids) for d in box.deltas] == expected_sizes(len(ids), interval)
    assert [d.finish_reason for d in box.deltas][-1] == "length"
    plain, _ = run(tokenizer, processor, SamplingParams(max_tokens=100), [one_per_step(ids)])
    assert [len(d.token_ids) for d in plain.deltas] == [1] * len(ids)
    assert joined(box.deltas) == joined(plain.deltas)


@pytest.mark.parametrize("case", ["stop", "stop-included", "logprobs", "n2", "multi-token-steps"])
def test_the_concatenation_equals_interval_1(tokenizer: Any, processor: Processor, encode: Any, case: str) -> None:
    ids = encode(GEN)
    streams = [one_per_step(ids)]
    params: dict[str, Any] = {"max_tokens": 100}
    if case.startswith("stop"):
        params.update(stop=["against th", "radio"], include_stop_str_in_output=case == "stop-included")
    elif case == "logprobs":
        params.update(logprobs=1)
    elif case == "n2":
        params.update(n=2, logprobs=0, stop=["somewhere"])
        other = encode(" a radio played somewhere near the boats")
        streams.append(one_per_step(other))
    else:  # several tokens per engine step (a clocked engine the frontend fell behind)
        streams = [[ids[0:1], ids[1:4], ids[4:6], ids[6:7], ids[7:12], ids[12:14], ids[14:]]]
    interval = 4
    held, _ = run(tokenizer, processor, SamplingParams(**params), streams, server_interval=interval)
    plain, _ = run(tokenizer, processor, SamplingParams(**params), streams)
    for index in range(len(streams)):
        ours, theirs = held.of(index), plain.of(index)
        assert joined(ours) == joined(theirs)
        assert len(ours) < len(theirs)
        sizes = [len(d.token_ids) for d in ours]
        assert sizes[0] == len(streams[index][0]) and all(s >= interval for s in sizes[1:-1])
        assert ours[-1].finished and not any(d.finished for d in ours[:-1])
    if case.startswith("stop"):
        assert plain.deltas[-1].finish_reason == "stop" and plain.deltas[-1].stop_reason == "against th"
    if case == "n2":  # each completion on its own count
        assert [len(d.token_ids) for d in held.of(1)][:3] == [1, 4, 4]


def test_the_requests_interval_is_clamped_up_to_the_servers(tokenizer: Any, processor: Processor,
                                                             encode: Any) -> None:
    ids = encode(GEN)
    for server, request, effective in [(4, 2, 4), (4, 8, 8), (1, 3, 3), (3, None, 3), (1, None, 1)]:
        box, _ = run(tokenizer, processor, SamplingParams(max_tokens=100, stream_interval=request),
                     [one_per_step(ids)], server_interval=server)
        assert [len(d.token_ids) for d in box.deltas] == expected_sizes(len(ids), effective), (server, request)


def test_a_request_without_a_collector_ignores_it(tokenizer: Any, processor: Processor, encode: Any) -> None:
    """The offline API folds every delta into whole outputs itself (vLLM's LLM ignores it too)."""
    ids = encode(GEN)
    _, returned = run(tokenizer, processor, SamplingParams(max_tokens=100, stream_interval=4), [one_per_step(ids)],
                      server_interval=4, collector=False)
    assert [len(d.token_ids) for d in returned] == [1] * len(ids)


def test_an_error_finish_carries_what_was_held(tokenizer: Any, processor: Processor, encode: Any) -> None:
    ids = encode(GEN)[:7]
    box, _ = run(tokenizer, processor, SamplingParams(max_tokens=100), [one_per_step(ids)], server_interval=4,
                 finish=p.FinishReason.ABORT)
    assert [len(d.token_ids) for d in box.deltas] == [1, 4, 2]
    assert box.deltas[-1].finish_reason == "abort"


def test_zero_or_a_non_integer_is_refused_by_name() -> None:
    for bad in (0, -1, 2**31, 1.5):
        with pytest.raises(ValidationError) as info:
            SamplingParams(stream_interval=bad)
        assert [v.field for v in info.value.violations] == ["stream_interval"]
    assert SamplingParams(stream_interval=1).stream_interval == 1


def test_the_server_flag_must_be_at_least_1(tiny_model_dir: Any) -> None:
    with pytest.raises(ConfigError, match="--stream-interval"):
        FrontendConfig(model=str(tiny_model_dir), stream_interval=0)


def test_tandem_serve_passes_the_flag_to_the_frontend(tiny_model_dir: Any, tmp_path: Any) -> None:
    args, engine_args = serve_cli.build_parser().parse_known_args(["--model", "m", "--stream-interval", "4"])
    serve_cli.prepare_secrets(args, tmp_path)
    engine, frontend = serve_cli.child_commands(args, engine_args)
    assert frontend[frontend.index("--stream-interval") + 1] == "4" and "--stream-interval" not in engine
    config = frontend_cli.config_from_args(frontend_cli.build_parser().parse_args(
        ["--model", str(tiny_model_dir), "--stream-interval", "4"]))
    assert config.stream_interval == 4
    default, _ = serve_cli.build_parser().parse_known_args(["--model", "m"])
    (tmp_path / "default").mkdir()
    serve_cli.prepare_secrets(default, tmp_path / "default")
    assert "--stream-interval" not in serve_cli.child_commands(default, [])[1]  # the frontend's default, 1


# ---- the gRPC API --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stacks(loop: LoopThread, tokenizer: Any, tiny_model_dir: Any) -> Iterator[tuple[Stack, Stack]]:
    """(a frontend with --stream-interval 3, one with the default 1), each with its fake engine."""
    held = Stack(loop, tokenizer, tiny_model_dir, step_s=0.01, stream_interval=3)
    plain = Stack(loop, tokenizer, tiny_model_dir, step_s=0.01)
    held.wait_serving()
    plain.wait_serving()
    yield held, plain
    held.close()
    plain.close()


@pytest.fixture()
def client(stacks: tuple[Stack, Stack]) -> Iterator[TandemClient]:
    with DeadlineClient(stacks[0].address) as c:
        yield c


@pytest.fixture()
def plain_client(stacks: tuple[Stack, Stack]) -> Iterator[TandemClient]:
    with DeadlineClient(stacks[1].address) as c:
        yield c


def sizes_of(responses: list[Any]) -> list[int]:
    return [len(r.token_ids) for r in responses]


def logprob_rows(responses: list[Any]) -> list[tuple[Any, ...]]:
    return [(e.token_id, e.logprob, e.rank, e.text, [(t.token_id, t.logprob) for t in e.top_logprobs])
            for r in responses for e in r.logprobs]


def test_grpc_streams_in_chunks_of_the_interval(client: TandemClient, plain_client: TandemClient) -> None:
    """The server's 3; a request's 6 raises it, its 2 does not lower it. Middle chunks may hold more
    (the collector merges for a reader that fell behind), never fewer. The whole equals interval 1's."""
    expected = list(plain_client.generate(PROMPT, max_tokens=40, temperature=0, logprobs=1, stop=["lazy"]))
    assert sizes_of(expected)[:3] == [1, 1, 1]
    for request, least in [(None, 3), (2, 3), (6, 6)]:
        responses = list(client.generate(PROMPT, max_tokens=40, temperature=0, logprobs=1, stop=["lazy"],
                                         stream_interval=request))
        sizes = sizes_of(responses)
        assert sizes[0] == 1 and all(s >= least for s in sizes[1:-1]) and len(sizes) > 2, (request, sizes)
        assert "".join(r.text for r in responses) == "".join(r.text for r in expected)
        assert [t for r in responses for t in r.token_ids] == [t for r in expected for t in r.token_ids]
        assert logprob_rows(responses) == logprob_rows(expected) and len(logprob_rows(expected)) == sum(sizes)
        last = responses[-1]
        assert (last.finish_reason, last.stop_string, last.usage) == (
            expected[-1].finish_reason, "lazy", expected[-1].usage)


def test_grpc_n2_streams_each_completion_in_chunks(client: TandemClient) -> None:
    responses = list(client.generate(PROMPT, n=2, seed=3, max_tokens=13, stream_interval=4))
    for index in (0, 1):
        sizes = sizes_of([r for r in responses if r.index == index])
        assert sizes[0] == 1 and sum(sizes) == 13 and all(s >= 4 for s in sizes[1:-1]), sizes


def test_grpc_zero_is_invalid_argument_naming_the_field(client: TandemClient) -> None:
    error = rpc_error(lambda: list(client.generate(PROMPT, max_tokens=4, stream_interval=0)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_fields(error) == ["sampling_params.stream_interval"]
