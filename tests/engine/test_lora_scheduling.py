"""LoRA in the scheduler and the prefix cache: the per-step adapter budget (exact admissions), no adapter
starving behind a busy one, adapter-keyed block hashes, unknown adapters refused, and the adapter id
sent to the workers."""

from __future__ import annotations

from typing import Any

from engine_svc.request import Request
from engine_svc.sched.scheduler import Scheduler
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams, ErrorCode
from shared_runtime.kv_hash import hash_block_tokens
from tests.engine.test_scheduler import EMPTY_RUN, run_model

LORAS = {"a": 1, "b": 2, "c": 3}


def sched(**overrides: Any) -> Scheduler:
    kwargs: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                  num_blocks=32, lora_ids=LORAS, max_loras=2)
    kwargs.update(overrides)
    return Scheduler(**kwargs)


def add(s: Scheduler, rid: str, lora: str = "", prompt: list[int] | None = None, max_tokens: int = 3) -> Request:
    req = Request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt or [1, 2, 3, 4, 5],
                                    sampling_params=EngineSamplingParams(max_tokens=max_tokens), lora_name=lora),
                  s.max_model_len)
    s.add_request(req)
    return req


def step(s: Scheduler) -> dict[str, int]:
    so = s.schedule()
    s.update_from_output(so, run_model(s, so))
    return so.num_scheduled_tokens


def drain(s: Scheduler) -> None:
    s.finish_requests(list(s.requests))
    s.update_from_output(s.schedule(), EMPTY_RUN)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_step_holds_at_most_max_loras_adapters_and_base_requests_pass() -> None:
    s = sched()
    for rid, lora in (("r1", "a"), ("r2", "b"), ("r3", "c"), ("r4", ""), ("r5", "a")):
        add(s, rid, lora, max_tokens=2 if rid in ("r1", "r2") else 3)
    # c does not fit (a, b hold both places); after it has waited, a's second request waits too (fair
    # order among adapters); the base request goes.
    assert list(step(s)) == ["r1", "r2", "r4"]
    assert [r.request_id for r in s.waiting] == ["r3", "r5"]
    assert list(step(s)) == ["r1", "r2", "r4"]  # r1 and r2 finish (max_tokens 2): their places free up
    assert sorted(step(s)) == ["r3", "r4", "r5"]  # c and a, two adapters
    drain(s)


def test_the_budget_counts_distinct_adapters_not_requests() -> None:
    s = sched(max_loras=1)
    for rid in ("x1", "x2", "x3"):
        add(s, rid, "b")
    add(s, "y", "a")
    assert list(step(s)) == ["x1", "x2", "x3"]
    assert [r.request_id for r in s.waiting] == ["y"]
    drain(s)


def test_new_request_data_carries_the_adapter_id() -> None:
    s = sched()
    add(s, "r1", "c")
    add(s, "r2", "")
    so = s.schedule()
    assert {n.req_id: n.lora_id for n in so.scheduled_new_reqs} == {"r1": 3, "r2": 0}
    s.update_from_output(so, run_model(s, so))
    drain(s)


def test_block_hashes_are_keyed_by_adapter() -> None:
    s = sched()
    prompt = list(range(1, 10))  # two full blocks of 4
    base, under_a, under_a2 = add(s, "p0", "", prompt), add(s, "p1", "a", prompt), add(s, "p2", "a", prompt)
    assert base.block_hashes[0] == hash_block_tokens(None, prompt[:4])
    assert under_a.block_hashes[0] == hash_block_tokens(None, prompt[:4], ("a", "1"))  # name and id (lora/registry.py)
    assert len({base.block_hashes[1], under_a.block_hashes[1]}) == 2
    assert under_a.block_hashes == under_a2.block_hashes
    drain(s)


def test_a_prefix_cached_under_one_adapter_never_serves_another() -> None:
    s = sched()
    prompt = list(range(1, 18))  # four full blocks
    add(s, "first", "a", prompt, max_tokens=1)
    step(s)
    assert not s.requests  # finished; its blocks stay cached
    for rid, lora in (("base", ""), ("other", "b"), ("same", "a")):
        req = add(s, rid, lora, prompt, max_tokens=1)
        step(s)
        assert req.num_cached_tokens == (16 if rid == "same" else 0), rid
    drain(s)


def test_unknown_or_unserved_adapters_are_refused_naming_the_field() -> None:
    for s, want in ((sched(), "serves a, b, c"), (sched(lora_ids=None), "without --enable-lora")):
        add(s, "u", "nope")
        out = s.update_from_output(s.schedule(), EMPTY_RUN)
        (o,) = out.outputs
        assert o.error is not None and o.error.code == ErrorCode.INVALID_ARGUMENT
        assert "lora_name" in o.error.message and "'nope'" in o.error.message and want in o.error.message
        drain(s)


def test_a_not_ready_adapters_requests_wait_in_line_without_holding_up_the_others() -> None:
    """An adapter loaded at run time that the workers are still reading (`lora_not_ready`): its request
    waits in its place; the base request and another adapter's behind it run; once ready, it runs."""
    s = sched()
    s.lora_not_ready.add(LORAS["a"])
    for rid, lora in (("slow", "a"), ("base", ""), ("other", "b")):
        add(s, rid, lora)
    assert sorted(step(s)) == ["base", "other"]
    assert [r.request_id for r in s.waiting] == ["slow"]
    s.lora_not_ready.clear()
    assert "slow" in step(s)
    drain(s)


def test_a_failed_read_ends_the_adapters_waiting_requests_once_with_an_error() -> None:
    s = sched()
    s.lora_not_ready.add(LORAS["a"])
    add(s, "doomed", "a")
    add(s, "base", "")
    so = s.schedule()
    s.fail_lora(LORAS["a"], "the file changed")
    outputs = s.update_from_output(so, run_model(s, so)).outputs
    ended = [o for o in outputs if o.request_id == "doomed"]
    assert len(ended) == 1 and ended[0].error.code == ErrorCode.INVALID_ARGUMENT
    assert ended[0].error.message == ("lora_name: the engine's workers could not read LoRA adapter 'a': "
                                      "the file changed")
    assert "doomed" not in s.requests and s.lora_not_ready == set()
    drain(s)
