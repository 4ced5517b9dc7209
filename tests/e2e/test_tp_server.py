"""`tandem-engine --tensor-parallel-size 2` (and `--pipeline-parallel-size 2`) end to end: two gloo worker processes behind the engine
service, a frontend in front, greedy output equal to transformers; SIGTERM drains and leaves no worker
process and no shared-memory segment behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from frontend_svc.client import collect
from tests.e2e.conftest import engine_service, frontend_service
from tests.engine.test_hf_exact import hf_greedy, make_prompts
from tests.support import DeadlineClient, free_port, wait_until

pytestmark = pytest.mark.slow


def _children(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        path = task / "children"
        if path.exists():
            kids |= {int(p) for p in path.read_text().split()}
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.parametrize("parallel", [("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "2")],
                         ids=["tp2", "pp2"])
def test_tp2_engine_serves_exact_tokens_and_exits_cleanly(make_model, tmp_path, parallel: tuple[str, str]) -> None:
    model = make_model("qwen2")  # one KV head: replicated across the two ranks; two layers: one per stage
    shm_before = set(os.listdir("/dev/shm"))
    engine = engine_service(model, free_port(), tmp_path, *parallel).start().wait_serving()
    frontend = frontend_service(model, engine.port, free_port(), tmp_path).start().wait_serving()
    workers = _children(engine.proc.pid)
    try:
        assert len(workers) >= 2, "the engine should have spawned one worker process per rank"
        with DeadlineClient(frontend.address) as client:
            for prompt in make_prompts(11, 3, 500):
                out = collect(client.generate(token_ids=prompt, temperature=0, max_tokens=8, ignore_eos=True))[0]
                assert list(out["token_ids"]) == hf_greedy(model, prompt, 8)[0]
    finally:
        frontend.stop()
        engine.proc.send_signal(signal.SIGTERM)
        assert engine.proc.wait(60) == 0
    wait_until(lambda: not any(_alive(w) for w in workers), timeout=10, what="TP workers to exit")
    time.sleep(0.2)
    assert set(os.listdir("/dev/shm")) - shm_before == set(), "shared-memory segments left behind"
