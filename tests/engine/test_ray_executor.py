"""`--distributed-executor-backend ray` on a local Ray cluster (CPU bundles, gloo): one actor per rank runs
the same worker as the multiproc executor and gives the same tokens (PP=2 against one process and
transformers; TP=2 x PP=2 against the mp executor), with P batches in flight; a rank that raises, an actor
killed mid-run or while idle fails the engine within seconds and leaves no actor behind; an existing
cluster is used (an earlier ray.init(), else RAY_ADDRESS's) and left running.

One local cluster for the module (4 CPUs, this process its driver): starting Ray costs seconds, and each
engine's actors import torch (the slow marks keep the default run to one exactness and two fault tests).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.executor import ray_executor
from engine_svc.executor.codec import Op
from engine_svc.executor.multiproc import WorkerDiedError
from engine_svc.executor.ray_executor import RayExecutor, connect_ray
from engine_svc.executor.worker_proc import FAULT_ENV
from entrypoints import LLM, SamplingParams
from tests.engine.test_hf_exact import MAX_TOKENS, assert_no_block_leaks, hf_greedy, make_prompts
from tests.engine.test_multiproc import process_gone
from tests.engine.test_pipeline_parallel import GREEDY, MaxInFlight, logprobs_of, token_ids
from tests.support import wait_until

pytestmark = pytest.mark.timeout(300)
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=32
)
RAY = dict(distributed_executor_backend="ray")


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This process is the driver of a local Ray cluster with 4 CPUs for the module (executors use it and
    leave it connected); stopped, with every actor, when the module ends."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray puts sockets under it
    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=temp_dir)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def llama3(make_model) -> Path:
    return make_model("llama", num_layers=3)


def actor_pids(llm: LLM) -> list[int]:
    executor = llm.engine.executor
    assert isinstance(executor, RayExecutor)
    return executor.worker_pids


def assert_actors_gone(pids: list[int]) -> None:
    assert pids and os.getpid() not in pids
    wait_until(lambda: all(map(process_gone, pids)), 15, f"Ray actors {pids} gone", interval=0.1)


# ---- the flag -----------------------------------------------------------------------------------------
def test_the_backend_flag_is_checked_and_defaults_by_world_size(monkeypatch) -> None:
    from engine_svc.executor import make_executor, multiproc, uniproc

    for module, name in ((uniproc, "UniprocExecutor"), (multiproc, "MultiprocExecutor"),
                         (ray_executor, "RayExecutor")):
        monkeypatch.setattr(module, name, lambda config, name=name: name)
    made = {backend: make_executor(EngineConfig(model="/x", distributed_executor_backend=backend))
            for backend in ("uni", "mp", "ray", None)}
    assert made == {"uni": "UniprocExecutor", "mp": "MultiprocExecutor", "ray": "RayExecutor",
                    None: "UniprocExecutor"}
    assert make_executor(EngineConfig(model="/x", pipeline_parallel_size=2)) == "MultiprocExecutor"
    assert EngineConfig(model="/x").executor_backend == "uni"
    assert EngineConfig(model="/x", tensor_parallel_size=2).executor_backend == "mp"
    assert EngineConfig(model="/x", tensor_parallel_size=2, **RAY).executor_backend == "ray"
    with pytest.raises(ConfigError, match="--distributed-executor-backend 'dask' is not supported"):
        EngineConfig(model="/x", distributed_executor_backend="dask")
    with pytest.raises(ConfigError, match="backend uni runs one worker"):
        EngineConfig(model="/x", pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ConfigError, match=r"ray places the workers .* drop --nnodes"):
        EngineConfig(model="/x", tensor_parallel_size=2, nnodes=2, master_port=1, **RAY)


# ---- exactness ----------------------------------------------------------------------------------------
def test_ray_pp2_equals_one_process_and_transformers(ray_session, llama3, monkeypatch) -> None:
    """Two actors, one per stage, placed in a placement group of two CPU bundles; both stages busy. Commands
    above 300 bytes (the steps that bring new prompts) go through the object store, the others inline."""
    monkeypatch.setattr(ray_executor, "INLINE_COMMAND_BYTES", 300)
    stored: list[int] = []
    sent: list[int] = []
    put, send = ray.put, RayExecutor._send
    monkeypatch.setattr(ray, "put", lambda value: stored.append(len(value)) or put(value))
    monkeypatch.setattr(RayExecutor, "_send", lambda self, *a: sent.append(1) or send(self, *a))
    prompts = make_prompts(3, 5, 500, lo=20, hi=30)
    llm = LLM(str(llama3), pipeline_parallel_size=2, **RAY, **ENGINE_ARGS)
    try:
        pids = actor_pids(llm)
        assert len(set(pids)) == 2
        spy = MaxInFlight(llm.engine)
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert 0 < len(stored) < len(sent) and min(stored) > 300, (len(stored), len(sent))
        assert spy.most == llm.engine.max_concurrent_batches == 2, "the pipeline never had both stages busy"
        assert llm.engine.get_stats().num_preemptions > 0
        assert_no_block_leaks(llm)
    finally:
        llm.engine.shutdown()
    assert_actors_gone(pids)
    assert ray.is_initialized(), "the driver's own Ray session stays connected"
    one = LLM(str(llama3), **ENGINE_ARGS)
    ref = one.generate(prompts, GREEDY, use_tqdm=False)
    one.engine.shutdown()
    assert token_ids(got) == token_ids(ref)
    for g, prompt in zip(got, prompts, strict=True):
        assert g.outputs[0].token_ids == hf_greedy(llama3, prompt, MAX_TOKENS)[0]
    for a, b in zip(logprobs_of(got), logprobs_of(ref), strict=True):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.slow
def test_ray_tp2_pp2_equals_the_mp_executor(ray_session, llama3) -> None:
    """Four actors (two stages of two TP ranks) against four mp worker processes: the same tokens and
    logprobs, greedy (chunked prefill, preemption) and seeded sampling."""
    prompts = make_prompts(3, 5, 500, lo=20, hi=30)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=10, logprobs=2)
              for i in range(len(prompts))]
    results = {}
    for backend in ("ray", "mp"):
        llm = LLM(str(llama3), pipeline_parallel_size=2, tensor_parallel_size=2,
                  distributed_executor_backend=backend, **ENGINE_ARGS)
        try:
            if backend == "ray":
                assert len(set(actor_pids(llm))) == 4
            results[backend] = [llm.generate(prompts, params, use_tqdm=False) for params in (GREEDY, seeded)]
            assert_no_block_leaks(llm)
        finally:
            llm.engine.shutdown()
    for got, want in zip(results["ray"], results["mp"], strict=True):
        assert token_ids(got) == token_ids(want)
        for a, b in zip(logprobs_of(got), logprobs_of(want), strict=True):
            assert a == pytest.approx(b, abs=1e-4)


def test_the_cluster_is_the_current_one_then_ray_address_then_a_new_local_one(monkeypatch) -> None:
    """connect_ray's choice (ray.init recorded, not run): an earlier ray.init() is used as it is and left
    connected; else RAY_ADDRESS's cluster; else a new local one ("local": never a stale `ray start`
    address) with a CPU per rank at least. It reports whether it connected (shutdown then disconnects)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert connect_ray(4, "cpu") is False and calls == []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    assert connect_ray(4, "cuda") is True and calls[-1]["address"] == "10.0.0.7:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert connect_ray(4, "cpu") is True
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] == 4


# ---- faults ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_exception_in_a_rank_fails_generate_and_ends_every_actor(ray_session, make_model, monkeypatch) -> None:
    """TANDEM_* variables reach the actors (the fault hook reads one)."""
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=4")
    llm = LLM(str(make_model("llama")), pipeline_parallel_size=2, **RAY, **ENGINE_ARGS)
    pids = actor_pids(llm)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 .*InjectedFault.*step 4"):
        llm.generate(make_prompts(8, 3, 500), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 15
    assert_actors_gone(pids)


@pytest.mark.parametrize("victim", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_sigkill_of_an_actor_fails_generate_and_ends_every_actor(ray_session, make_model, victim: int) -> None:
    """Killing either stage's actor (the first: the last waits for activations; the last: the one that
    answers) fails the next step within seconds, naming the rank."""
    llm = LLM(str(make_model("llama")), pipeline_parallel_size=2, **RAY, **ENGINE_ARGS)
    pids = actor_pids(llm)
    llm.generate(make_prompts(9, 2, 500), GREEDY, use_tqdm=False)  # healthy first
    os.kill(pids[victim], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"rank {victim} \(.*ActorDiedError"):
        llm.generate(make_prompts(10, 2, 500), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert_actors_gone(pids)


def test_an_idle_actor_death_is_noticed_by_the_health_check(ray_session, make_model) -> None:
    config = EngineConfig.create(model=str(make_model("llama")), tensor_parallel_size=2, **RAY, **ENGINE_ARGS)
    executor = RayExecutor(config)
    try:
        executor.initialize()
        executor.check_health()
        os.kill(executor.worker_pids[1], signal.SIGKILL)

        def noticed() -> bool:
            try:
                executor.check_health()
            except WorkerDiedError as exc:
                assert "rank 1" in str(exc)
                return True
            return False

        wait_until(noticed, 10, "the dead actor noticed", interval=0.2)
        assert_actors_gone(executor.worker_pids)
    finally:
        executor.shutdown()


def test_broadcasts_from_two_threads_reach_every_actor_in_one_order() -> None:
    """The step loop and a P/D pull's thread broadcast at once: each actor must see the commands in the same
    order (the collectives inside them pair up rank by rank), so one broadcast's calls are never split by
    another's. Fake actors record what they are sent; submitting a call yields the GIL between ranks."""
    import threading

    class Recorder:
        def __init__(self, seen: list[bytes]) -> None:
            self.seen = seen

        def remote(self, command: bytes) -> None:
            time.sleep(0.001)  # another thread's broadcast may run here
            self.seen.append(command)

    class FakeActor:
        def __init__(self) -> None:
            self.seen: list[bytes] = []
            self.run = Recorder(self.seen)

    executor = RayExecutor.__new__(RayExecutor)
    actors = [FakeActor() for _ in range(4)]
    executor._actors = actors
    executor._send_lock = threading.Lock()
    executor._failure = None
    executor._finalizer = type("Alive", (), {"alive": True})()

    def broadcast(block_ids: list[int]) -> None:
        for _ in range(20):
            executor._send(Op.KV_READ, block_ids)

    threads = [threading.Thread(target=broadcast, args=([n],)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(actors[0].seen) == 60
    assert all(actor.seen == actors[0].seen for actor in actors)
