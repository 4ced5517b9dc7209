"""`tandem-engine --distributed-executor-backend ray` end to end: the engine starts its own local Ray cluster
(no RAY_ADDRESS) with PP=2 as two actors, a frontend in front gets greedy output equal to transformers;
kill -9 of the last stage's actor mid-stream ends the stream with UNAVAILABLE, the engine exits non-zero,
and every process it started (Ray's included) is gone."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import grpc
import pytest

from frontend_svc.client import collect
from tests.e2e.conftest import engine_service, frontend_service
from tests.engine.test_hf_exact import hf_greedy, make_prompts
from tests.engine.test_multiproc import process_gone
from tests.support import DeadlineClient, free_port, wait_until

pytestmark = pytest.mark.slow


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of `pid`: its command line."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            for kid in kids:
                try:
                    found[kid] = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                todo.append(kid)
    return found


def test_ray_engine_serves_exact_tokens_and_exits_non_zero_when_an_actor_dies(make_model, tmp_path) -> None:
    model = make_model("qwen2")
    engine = engine_service(model, free_port(), tmp_path, "--distributed-executor-backend", "ray",
                            "--pipeline-parallel-size", "2").start()
    frontend = None
    try:
        engine.wait_serving()
        frontend = frontend_service(model, engine.port, free_port(), tmp_path).start().wait_serving()
        with DeadlineClient(frontend.address) as client:
            for prompt in make_prompts(11, 2, 500):
                out = collect(client.generate(token_ids=prompt, temperature=0, max_tokens=8, ignore_eos=True))[0]
                assert list(out["token_ids"]) == hf_greedy(model, prompt, 8)[0]
            started = descendants(engine.proc.pid)
            actors = sorted(pid for pid, cmd in started.items() if "RankActor" in cmd)
            assert len(actors) == 2, started
            stream = client.generate(token_ids=[5, 9, 14], temperature=0, max_tokens=400, ignore_eos=True)
            assert next(iter(stream)) is not None  # mid-stream
            threading.Timer(0.2, lambda: os.kill(actors[-1], signal.SIGKILL)).start()
            with pytest.raises(grpc.RpcError) as caught:
                for _ in stream:
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert engine.proc.wait(30) != 0, "an engine whose actor died must exit non-zero"
        wait_until(lambda: all(map(process_gone, started)), 30, f"the engine's processes {started} gone", interval=0.2)
    finally:
        if frontend is not None:
            frontend.stop()
        engine.kill()
