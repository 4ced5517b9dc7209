"""`tandem-engine --nnodes 2` end to end on loopback: node 0 serves (PP=2, the first stage), node 1 is a
`tandem-engine --headless` process (the last stage, which answers); a frontend in front gets greedy
output equal to transformers. kill -9 of the headless node mid-stream: the stream ends with an error
(UNAVAILABLE) and the engine exits non-zero, so an orchestrator restarts the group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from frontend_svc.client import collect
from tests.e2e.conftest import ENGINE_FLAGS, engine_service, frontend_service
from tests.engine.test_hf_exact import hf_greedy, make_prompts
from tests.engine.test_multinode import two_free_ports
from tests.support import DeadlineClient, free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_two_node_engine_serves_exact_tokens_and_exits_non_zero_when_a_node_dies(make_model, tmp_path) -> None:
    model = make_model("qwen2")
    master = two_free_ports()
    nodes = ("--nnodes", "2", "--master-port", str(master), "--pipeline-parallel-size", "2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
    with (tmp_path / "headless.log").open("wb") as log:
        headless = subprocess.Popen([sys.executable, "-m", "engine_svc.cli", "--headless", "--model", str(model),
                                     *ENGINE_FLAGS, *nodes, "--node-rank", "1"], env=env, stdout=log, stderr=log)
    engine = engine_service(model, free_port(), tmp_path, *nodes).start()
    frontend = None
    try:
        engine.wait_serving()
        frontend = frontend_service(model, engine.port, free_port(), tmp_path).start().wait_serving()
        with DeadlineClient(frontend.address) as client:
            for prompt in make_prompts(11, 3, 500):
                out = collect(client.generate(token_ids=prompt, temperature=0, max_tokens=8, ignore_eos=True))[0]
                assert list(out["token_ids"]) == hf_greedy(model, prompt, 8)[0]
            stream = client.generate(token_ids=[5, 9, 14], temperature=0, max_tokens=400, ignore_eos=True)
            first = next(iter(stream))  # mid-stream
            assert first is not None
            threading.Timer(0.2, lambda: headless.send_signal(signal.SIGKILL)).start()
            with pytest.raises(grpc.RpcError) as caught:
                for _ in stream:
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert engine.proc.wait(30) != 0, "an engine whose node died must exit non-zero"
    finally:
        if frontend is not None:
            frontend.stop()
        engine.kill()
        if headless.poll() is None:
            headless.kill()
        headless.wait(10)
