"""Headless nodes must run with node 0's model and worker flags: the fingerprint in the node link's HELLO
is compared at join time; a node that differs is refused before it starts a worker, and both sides say
which flags differ (node 0 fails start-up, the headless node gets the same reason). Loopback sockets,
no worker processes: node 0's `accept_nodes` here, the node's `connect_to_engine` on a thread."""

from __future__ import annotations

import re
import threading
from typing import Any

from engine_svc.config import EngineConfig
from engine_svc.executor.fingerprint import encode_fingerprint, fingerprint_mismatch
from engine_svc.executor.nodes import accept_nodes, connect_to_engine
from tests.engine.test_multinode import two_free_ports

NODE0: dict[str, Any] = dict(model="/models/m", nnodes=2, pipeline_parallel_size=2, device="cpu")


def join(node0: EngineConfig, node1: EngineConfig) -> tuple[object, object]:
    """(what accept_nodes returned or raised, what connect_to_engine returned or raised)."""
    results: dict[str, object] = {}

    def headless() -> None:
        try:
            results["node"] = connect_to_engine(node1, timeout_s=20)
        except RuntimeError as exc:
            results["node"] = exc

    thread = threading.Thread(target=headless)
    thread.start()
    try:
        engine: object = accept_nodes(node0, timeout_s=20)
    except RuntimeError as exc:
        engine = exc
    thread.join(20)
    for end in (engine, results["node"]):
        for sock in (end if isinstance(end, list) else [end]):
            getattr(sock, "close", lambda: None)()
    return engine, results["node"]


def test_a_node_with_node_0s_flags_is_welcomed() -> None:
    port = two_free_ports()
    engine, node = join(EngineConfig(master_port=port, **NODE0),
                        EngineConfig(master_port=port, node_rank=1, master_addr="127.0.0.1", **NODE0))
    assert isinstance(engine, list) and [n.node_rank for n in engine] == [1]
    assert not isinstance(node, Exception), node


def test_a_node_with_other_parallel_flags_is_refused_naming_them() -> None:
    port = two_free_ports()
    other = {**NODE0, "pipeline_parallel_size": 1, "tensor_parallel_size": 2}
    engine, node = join(EngineConfig(master_port=port, **NODE0),
                        EngineConfig(master_port=port, node_rank=1, **other))
    want = (r"node 1 runs with other flags than node 0: --tensor-parallel-size \(node 0: 1, node 1: 2\); "
            r"--pipeline-parallel-size \(node 0: 2, node 1: 1\)\. Start every node")
    assert isinstance(engine, RuntimeError)
    assert isinstance(node, RuntimeError)
    assert str(engine) == str(node)
    assert re.match(want, str(engine)), str(engine)


def test_the_fingerprint_covers_the_model_and_worker_flags_not_the_nodes_place() -> None:
    base = EngineConfig(master_port=1, **NODE0)
    same_place = EngineConfig(**{**NODE0, "master_port": 1, "node_rank": 1, "master_addr": "10.0.0.1",
                                 "scheduling_policy": "priority", "served_model_name": "x"})
    assert fingerprint_mismatch(base, encode_fingerprint(same_place), 1) is None
    for flag, value in (("model", "/models/other"), ("dtype", "bfloat16"), ("block_size", 32),
                        ("max_model_len", 4096), ("enable_lora", True), ("pp_layer_partition", "1,1")):
        changed = EngineConfig(**{**NODE0, "master_port": 1, "node_rank": 1, flag: value})
        message = fingerprint_mismatch(base, encode_fingerprint(changed), 1)
        assert message is not None and f"--{flag.replace('_', '-')} (node 0: " in message, flag
    assert "no readable configuration" in str(fingerprint_mismatch(base, b"", 1))
