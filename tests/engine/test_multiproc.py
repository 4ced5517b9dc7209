"""MultiprocExecutor with a fake worker (no model): protocol, codec, failure handling and cleanup.

The fake worker runs in real spawned processes inside a real gloo TP group: each step it all-reduces
a number derived from the SchedulerOutput, so a correct answer proves every rank got the same message.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from engine_svc.config import EngineConfig
from engine_svc.executor import codec
from engine_svc.executor.codec import Op, WorkerInfo
from engine_svc.executor.multiproc import MultiprocExecutor, WorkerDiedError
from engine_svc.executor.worker_proc import FAULT_ENV, parse_fault
from engine_svc.sched.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from shared_runtime.contract import EngineSamplingParams
from tests.support import wait_until

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[2]
FAKE = "tests.engine.test_multiproc:FakeWorker"
SLEEP_TOKENS = 999  # a step with this many tokens makes the fake worker sleep (to kill it mid-step)


class FakeWorker:
    """Stands in for engine_svc.worker.Worker: rank r offers 100 - 10 r blocks; steps all-reduce."""

    kv_block_bytes = 4096

    def __init__(self, config: EngineConfig, rank: int) -> None:
        import torch

        self.rank = rank
        self.device = torch.device("cpu")
        self.model = None

    def load_model(self) -> None:
        self.model = SimpleNamespace(vocab_size=321)

    def determine_num_blocks(self) -> int:
        return 100 - 10 * self.rank

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.num_blocks, self.max_model_len = num_blocks, max_model_len

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        import torch
        import torch.distributed as dist

        if so.total_num_scheduled_tokens == SLEEP_TOKENS:
            time.sleep(60)
        t = torch.tensor([so.total_num_scheduled_tokens * 10 + self.rank], dtype=torch.int64)
        dist.all_reduce(t)
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[int(t)] * len(req_ids))


def make_so(num_tokens: int, num_reqs: int = 2, prompt_len: int = 4) -> SchedulerOutput:
    params = EngineSamplingParams(temperature=0.5, top_k=7, seed=11, stop_token_ids=[3, 4], logprobs=2)
    new = [
        NewRequestData(
            req_id=f"n{i}",
            token_ids=list(range(prompt_len)),
            num_prompt_tokens=prompt_len,
            sampling_params=params,
            block_ids=[i, i + 1],
            num_computed_tokens=0,
            eos_token_ids=[1],
        )
        for i in range(num_reqs)
    ]
    cached = [CachedRequestData(req_id="c0", new_token_ids=[9], new_block_ids=[], num_computed_tokens=5)]
    sched = {r.req_id: num_tokens for r in new} | {"c0": 1}
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=sched,
        total_num_scheduled_tokens=num_tokens,
        finished_req_ids=["x"],
        preempted_req_ids=["y"],
    )


def config(tp: int = 2) -> EngineConfig:
    return EngineConfig(model="/nonexistent-fake-model", tensor_parallel_size=tp, device="cpu")


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def segments_of(executor: MultiprocExecutor) -> list[str]:
    return [f"/dev/shm/{name}" for name in executor.shm_names]


def assert_cleaned_up(pids: list[int], segments: list[str]) -> None:
    """Every worker process has exited (within 10 s) and no shared-memory segment is left."""
    assert pids and segments, "nothing to check"
    wait_until(lambda: all(map(process_gone, pids)), 10, f"worker processes {pids} gone", interval=0.05)
    assert not any(map(os.path.exists, segments)), segments


# ---- codec -------------------------------------------------------------------------------------------
def test_scheduler_output_round_trips_with_nested_sampling_params() -> None:
    so = make_so(5)
    back = codec.decode_scheduler_output(codec.encode_scheduler_output(so))
    assert back == so
    assert back.scheduled_new_reqs[0].sampling_params.stop_token_ids == [3, 4]
    op, body = codec.decode_command(memoryview(codec.encode_command(Op.EXECUTE, so)))
    assert op is Op.EXECUTE and body == so


def test_runner_output_and_commands_round_trip() -> None:
    out = ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=[5, -1],
        logprobs=[(-0.5, 1, [5, 6], [-0.5, -1.5]), None],
        prompt_logprobs={"a": [(7, -2.0, 3, [1], [-0.1])]},
    )
    assert codec.decode_runner_output(codec.encode_runner_output(out)) == out
    spec = codec.CacheSpec(num_blocks=42, max_model_len=640)
    assert codec.decode_command(codec.encode_command(Op.INIT_CACHE, spec)) == (Op.INIT_CACHE, spec)
    assert codec.decode_command(codec.encode_command(Op.SHUTDOWN)) == (Op.SHUTDOWN, None)
    info = WorkerInfo(num_blocks=3, vocab_size=9, kv_block_bytes=64)
    assert codec.decode_worker_info(codec.encode_worker_info(info)) == info
    with pytest.raises(ValueError):
        codec.encode_command(Op.EXECUTE)
    with pytest.raises(msgspec.ValidationError):
        codec.decode_command(codec.encode_command(Op.INIT_CACHE, "not an int"))


def test_parse_fault() -> None:
    assert parse_fault("rank=1,step=3", 1) == 3
    assert parse_fault("rank=1,step=3", 0) is None
    assert parse_fault(None, 0) is None


# ---- executor ----------------------------------------------------------------------------------------
def test_executor_broadcasts_to_every_rank_and_cleans_up() -> None:
    ex = MultiprocExecutor(config(), worker_cls=FAKE)
    pids, segments = ex.worker_pids, segments_of(ex)
    assert len(pids) == 2 and all(map(os.path.exists, segments))
    assert ex.initialize() == 90  # min(100, 90) over the ranks
    assert (ex.vocab_size, ex.kv_block_bytes) == (321, 4096)
    for step in range(1, 12):  # more steps than ring slots
        out = ex.execute_model(make_so(step))
        assert out.req_ids == ["n0", "n1", "c0"]
        assert out.sampled_token_ids == [2 * step * 10 + 1] * 3  # sum over ranks of (10 T + rank)
    big = make_so(7, num_reqs=3, prompt_len=800_000)  # ~ 7 MB encoded: the overflow pipe carries it
    assert len(codec.encode_scheduler_output(big)) > 4 << 20
    assert ex.execute_model(big).sampled_token_ids == [141] * 4
    ex.check_health()
    ex.shutdown()
    ex.shutdown()  # idempotent
    assert_cleaned_up(pids, segments)


def test_exception_in_one_ranks_forward_fails_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=3")
    ex = MultiprocExecutor(config(), worker_cls=FAKE)
    pids, segments = ex.worker_pids, segments_of(ex)
    ex.initialize()
    ex.execute_model(make_so(1))
    ex.execute_model(make_so(2))
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 .*InjectedFault"):
        ex.execute_model(make_so(3))
    assert time.monotonic() - start < 10
    assert_cleaned_up(pids, segments)
    with pytest.raises(WorkerDiedError):
        ex.check_health()


def test_sigkill_of_a_worker_mid_step_fails_promptly() -> None:
    ex = MultiprocExecutor(config(), worker_cls=FAKE)
    pids, segments = ex.worker_pids, segments_of(ex)
    ex.initialize()
    ex.execute_model(make_so(1))
    killer = threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .*code -9"):
        ex.execute_model(make_so(SLEEP_TOKENS))  # both ranks are busy (asleep) when rank 1 dies
    assert time.monotonic() - start < 10
    assert_cleaned_up(pids, segments)


def test_sigkill_between_steps_is_seen_by_check_health() -> None:
    ex = MultiprocExecutor(config(), worker_cls=FAKE)
    pids, segments = ex.worker_pids, segments_of(ex)
    ex.initialize()
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 5
    with pytest.raises(WorkerDiedError, match="rank 0"):
        while time.monotonic() < deadline:
            ex.check_health()
            time.sleep(0.02)
    assert_cleaned_up(pids, segments)


_ENGINE_SCRIPT = textwrap.dedent("""
    import sys, time
    from engine_svc.config import EngineConfig
    from engine_svc.executor.multiproc import MultiprocExecutor
    from engine_svc.sched.output import SchedulerOutput
    if __name__ == "__main__":
        ex = MultiprocExecutor(EngineConfig(model="/x", tensor_parallel_size=2, device="cpu"),
                               worker_cls="tests.engine.test_multiproc:FakeWorker")
        ex.initialize()
        print(*ex.worker_pids, *ex.shm_names, flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_engine_process_death_leaves_no_workers_or_segments(sig: int) -> None:
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_SCRIPT],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        fields = engine.stdout.readline().split()  # type: ignore[union-attr]
        assert len(fields) == 3, engine.stderr.read()  # type: ignore[union-attr]
        pids = [int(f) for f in fields[:2]]
        segments = [f"/dev/shm/{name}" for name in fields[2:]]
        engine.send_signal(sig)
        engine.wait(15)
        stderr = engine.stderr.read()  # type: ignore[union-attr]
    finally:
        engine.kill()
    assert engine.returncode == -sig
    # SIGTERM: the executor's handler stops the workers and unlinks. SIGKILL: the workers notice their
    # parent is gone and exit; the shared resource tracker then unlinks the segments.
    assert_cleaned_up(pids, segments)
    if sig == signal.SIGTERM:
        assert "leaked" not in stderr and "Traceback" not in stderr, stderr


def test_steps_in_flight_are_answered_in_order() -> None:
    """The batch queue's use: several steps submitted before any answer is read; each future gets its own
    answer, whichever is asked for first."""
    ex = MultiprocExecutor(config(), worker_cls=FAKE)
    pids, segments = ex.worker_pids, segments_of(ex)
    ex.initialize()
    futures = [ex.execute_model(make_so(step), non_block=True) for step in (1, 2, 3)]
    assert futures[2].result().sampled_token_ids == [61] * 3  # reads the answers to steps 1 and 2 first
    assert futures[0].done() and futures[1].done()
    assert [f.result().sampled_token_ids[0] for f in futures] == [21, 41, 61]
    fourth = ex.execute_model(make_so(4), non_block=True)
    assert ex.execute_model(make_so(5)).sampled_token_ids == [101] * 3  # step 4's answer is read on the way
    assert fourth.done() and fourth.result().sampled_token_ids == [81] * 3
    ex.shutdown()
    assert_cleaned_up(pids, segments)
