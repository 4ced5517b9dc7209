"""One engine over two "nodes" on loopback: node 0 is this process's engine (the offline LLM) with its
share of the ranks, node 1 a `tandem-engine --headless` process with the rest. Token-exact against one
process with PP=2 (the answering last stage on the headless node) and TP=2 (one rank on each node); a
headless node or one of its workers killed mid-run fails the engine within seconds; a node that never
joins fails start-up naming its ranks; a headless node exits 0 after the engine's shutdown, 1 when its
engine vanishes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.executor.multiproc import WorkerDiedError
from engine_svc.executor.nodes import JOIN_TIMEOUT_ENV
from entrypoints import LLM, SamplingParams
from tests.engine.test_hf_exact import MAX_TOKENS, assert_no_block_leaks, hf_greedy, make_prompts
from tests.support import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=32
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
REPO = Path(__file__).resolve().parents[2]


def two_free_ports() -> int:
    """A port p such that p and p + 1 are free on loopback (torch.distributed, the node link)."""
    return free_port(span=2)


def start_headless(model: Path, port: int, *flags: str) -> subprocess.Popen:
    args = ["--model", str(model), "--nnodes", "2", "--node-rank", "1", "--master-port", str(port),
            "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--max-num-batched-tokens", "16",
            "--num-gpu-blocks-override", "32", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
    return subprocess.Popen([sys.executable, "-c", "import sys; from engine_svc.cli import main; sys.exit(main())",
                             "--headless", *args], env=env)


@pytest.fixture
def headless() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        path = task / "children"
        if path.exists():
            kids += [int(p) for p in path.read_text().split()]
    return sorted(p for p in kids if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes())


@pytest.mark.parametrize("parallel", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}],
                         ids=["pp2", "tp2"])
def test_two_nodes_equal_one_process_and_transformers(make_model, headless, parallel: dict[str, int]) -> None:
    model = make_model("llama", num_layers=3)
    port = two_free_ports()
    flag, size = next(iter(parallel.items()))
    headless.append(start_headless(model, port, f"--{flag.replace('_', '-')}", str(size)))
    prompts = make_prompts(3, 5, 500, lo=20, hi=30)
    llm = LLM(str(model), nnodes=2, master_port=port, **parallel, **ENGINE_ARGS)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_no_block_leaks(llm)
    finally:
        llm.engine.shutdown()
    assert headless[0].wait(30) == 0, "a headless node exits 0 when its engine shuts down"
    one = LLM(str(model), **ENGINE_ARGS)
    ref = one.generate(prompts, GREEDY, use_tqdm=False)
    one.engine.shutdown()
    for g, r, prompt in zip(got, ref, prompts, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS)[0]
        assert [e.logprob for e in g.outputs[0].logprobs] == pytest.approx(
            [e.logprob for e in r.outputs[0].logprobs], abs=1e-4)


@pytest.mark.parametrize("victim", ["node", "worker", "local"])
def test_a_dead_node_or_worker_fails_the_whole_group_within_seconds(make_model, headless, victim: str) -> None:
    """kill -9 of the headless node, of its worker, or of a worker on node 0: the engine fails within
    seconds naming the cause, and a surviving headless node exits non-zero (it gets no SHUTDOWN)."""
    model = make_model("llama")
    port = two_free_ports()
    headless.append(start_headless(model, port, "--pipeline-parallel-size", "2"))
    llm = LLM(str(model), nnodes=2, master_port=port, pipeline_parallel_size=2, **ENGINE_ARGS)
    try:
        llm.generate(make_prompts(9, 2, 500), GREEDY, use_tqdm=False)  # healthy first
        relay = headless[0].pid
        pid = {"node": relay, "worker": children(relay)[0] if victim == "worker" else 0,
               "local": llm.engine.executor.worker_pids[0]}[victim]  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        cause = {"node": r"node 1", "worker": r"(?s)node 1: .*rank 1 .*code -9", "local": r"rank 0 .*code -9"}
        with pytest.raises(WorkerDiedError, match=cause[victim]):
            llm.generate(make_prompts(10, 2, 500), GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.engine.shutdown()
    if victim != "node":
        assert headless[0].wait(30) == 1, "a headless node of a failed engine exits non-zero"


def test_a_node_that_never_joins_fails_start_up_naming_its_ranks(make_model, monkeypatch) -> None:
    monkeypatch.setenv(JOIN_TIMEOUT_ENV, "3")
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"never joined within 3 s: node 1 \(ranks 2-3\)"):
        LLM(str(make_model("llama")), nnodes=2, master_port=two_free_ports(), pipeline_parallel_size=2,
            tensor_parallel_size=2, **ENGINE_ARGS)
    assert time.monotonic() - start < 30


def test_a_headless_node_whose_engine_vanishes_exits_non_zero(make_model, headless) -> None:
    """The engine side here is a bare listener that accepts the node's link, then closes it."""
    port = two_free_ports()
    with socket.create_server(("127.0.0.1", port + 1)) as server:
        headless.append(start_headless(make_model("llama"), port, "--pipeline-parallel-size", "2"))
        server.settimeout(120)
        conn, _ = server.accept()
        conn.recv(64)  # its hello
        conn.close()
    assert headless[0].wait(60) == 1


def test_node_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="--node-rank 2 must be in"):
        EngineConfig(model="/x", nnodes=2, node_rank=2, master_port=1)
    with pytest.raises(ConfigError, match="must be divisible by --nnodes 2"):
        EngineConfig(model="/x", nnodes=2, master_port=1, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="needs --master-port"):
        EngineConfig(model="/x", nnodes=2, tensor_parallel_size=2)


def test_a_headless_node_with_other_flags_is_refused_at_join(make_model, headless) -> None:
    """Node 0 runs PP=2, the headless node TP=2 (both a world of two): node 0 fails start-up naming the
    differing flags, the node exits 1 without starting a worker."""
    model = make_model("llama")
    port = two_free_ports()
    headless.append(start_headless(model, port, "--tensor-parallel-size", "2"))
    with pytest.raises(WorkerDiedError, match=r"node 1 runs with other flags than node 0: --tensor-parallel-size "
                                              r"\(node 0: 1, node 1: 2\); --pipeline-parallel-size"):
        LLM(str(model), nnodes=2, master_port=port, pipeline_parallel_size=2, **ENGINE_ARGS)
    assert headless[0].wait(60) == 1


def test_a_producer_spanning_two_nodes_feeds_a_decode_engine_exactly(make_model, headless) -> None:
    """P/D across nodes: a producer whose two pipeline stages live on two nodes (the answering last stage on
    the headless one) keeps a prefill's blocks; a one-device consumer pulls them — KV_DESCRIBE and KV_READ
    broadcast to both nodes, the stages' shards gathered to the headless answer rank, the bytes relayed back
    over the node link — and decodes the tokens of one engine alone; the producer's blocks come back."""
    from engine_svc.api.server import EngineServer
    from engine_svc.core import EngineCore
    from engine_svc.kv_transfer.config import KVTransferConfig
    from tests.engine.test_engine_server import ServerThread
    from tests.engine.test_kv_transfer import GREEDY as PD_GREEDY
    from tests.engine.test_kv_transfer import PROMPT, _config, _prefill, _stop
    from tests.engine.test_kv_transfer_tp import _continue_and_check, _expected
    from tests.engine_stream import engine_idle, engine_load
    from tests.support import wait_until

    model = make_model("llama", num_layers=3)
    one_engine = EngineCore(_config(model))
    want = _expected(one_engine, "u-nodes")
    one_engine.shutdown()
    port = two_free_ports()
    headless.append(start_headless(model, port, "--pipeline-parallel-size", "2"))
    config = EngineConfig.create(model=str(model), nnodes=2, master_port=port, pipeline_parallel_size=2,
                                 kv_transfer_config=KVTransferConfig(kv_role="kv_producer"), **ENGINE_ARGS)
    producer = ServerThread(EngineServer(config, host="127.0.0.1", port=0)).start()
    consumer = None
    try:
        wait_until(lambda: engine_idle(producer.address), 120, "the two-node producer up", retry_on=(Exception,))
        first = _prefill(producer, "p-nodes", PROMPT, PD_GREEDY)
        assert list(first.new_token_ids) == want[0][:1]
        assert engine_load(producer.address).num_free_blocks == 32 - 5  # held for the pull
        consumer = EngineCore(_config(model, KVTransferConfig(kv_role="kv_consumer", kv_pull_timeout_s=30)))
        _continue_and_check(consumer, "d-nodes", first, want, pulled=5, failures=0)
        wait_until(lambda: engine_idle(producer.address), 30, "the producer's blocks freed after the pull")
    finally:
        if consumer is not None:
            consumer.shutdown()
        _stop(producer)
    assert headless[0].wait(30) == 0
