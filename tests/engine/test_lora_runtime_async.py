"""A LoRA adapter loaded at run time is read off the step loop (engine_svc/lora/reader.py, runtime_loads.py):
while a worker's read is held on purpose (the reader's test gate), a victim request keeps producing a
token every step and the new adapter's request waits; once every rank holds it, that request runs with
PEFT's tokens. An unload during the read, a read that fails, a replace during the read and TP=2 with one
rank slower than the other: every request ends exactly once, with the exact tokens, and every block and
adapter copy comes back."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine_svc.lora.reader import GATE_ENV
from entrypoints import LLM
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams
from tests.engine.lora_support import ALL_MODULES, make_adapter, make_prompts, peft_greedy

MAX_TOKENS = 8
HELD_STEPS = 6  # steps the victim runs while the read is held
WATCHDOG_S = 20.0  # a step loop that waits for the held read is freed after this (and the test fails)


@pytest.fixture(scope="module")
def adapters(make_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    model_dir = make_model("llama")
    root = tmp_path_factory.mktemp("async-adapters")
    return model_dir, {
        "x": make_adapter(model_dir, root / "x", rank=8, alpha=16, targets=ALL_MODULES, seed=61),
        "z": make_adapter(model_dir, root / "z", rank=2, alpha=4, targets=("o_proj", "up_proj"), seed=63),
    }


class Gate:
    """The reader's test gate (a file): closed until `open()`; once `arm()`ed, a watchdog opens it after
    WATCHDOG_S so a step loop that waits for the read comes free, and `opened_by_watchdog` tells the test."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.opened_by_watchdog = False
        self._timer = threading.Timer(WATCHDOG_S, self._watchdog)
        self._timer.daemon = True

    def arm(self) -> None:
        self._timer.start()

    def _watchdog(self) -> None:
        self.opened_by_watchdog = True
        self.open()

    def open(self) -> None:
        self._timer.cancel()
        self.path.touch()


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Gate:
    monkeypatch.setenv(GATE_ENV, str(tmp_path / "gate"))
    return Gate(tmp_path / "gate")


def _llm(model_dir: Path, **args) -> LLM:
    return LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8, **args)


def _request(rid: str, prompt: list[int], lora: str, max_tokens: int = MAX_TOKENS) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, lora_name=lora,
                             sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                  ignore_eos=True))


class Run:
    """Steps an engine core and collects each request's tokens and its one terminal output."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.engine
        self.tokens: dict[str, list[int]] = {}
        self.ends: dict[str, str] = {}  # request id -> its error message ("" = finished normally)

    def step(self) -> set[str]:
        """One step; the ids that got tokens in it."""
        got = set()
        for o in self.core.step().outputs:
            assert o.request_id not in self.ends, f"{o.request_id} output after its end"
            if o.new_token_ids:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                got.add(o.request_id)
            if o.finish_reason:  # UNSPECIFIED (0): still running
                self.ends[o.request_id] = o.error.message if o.error is not None else ""
        return got

    def drain(self) -> None:
        while self.core.has_unfinished_requests():
            self.step()


def _hold_while_victim_runs(run: Run, gate: Gate, lora_id: int) -> None:
    """HELD_STEPS steps in which the victim gets a token each and the held adapter stays not ready (the
    step's thread team lends the reader a core meanwhile)."""
    gate.arm()
    for _ in range(HELD_STEPS):
        assert "victim" in run.step()
        assert lora_id in run.core.scheduler.lora_not_ready
    assert not gate.opened_by_watchdog, "the step loop waited for the held read"


def _victim_beside_a_held_load(llm: LLM, adapter: Path, gate: Gate,
                               seed: int) -> tuple[Run, list[int], list[int], int]:
    """A base-model victim decoding, adapter "x" loaded at run time with its read held on `gate`, and a
    request "new" on it waiting while the victim runs HELD_STEPS steps."""
    run, registry = Run(llm), llm.engine.loras
    victim, prompt = make_prompts(seed, 2, 500, lo=10, hi=10)
    run.core.add_request(_request("victim", victim, "", max_tokens=HELD_STEPS + MAX_TOKENS + 4))
    run.step()
    lora_id = registry.add("x", str(adapter)).lora_id
    run.core.add_request(_request("new", prompt, "x"))
    _hold_while_victim_runs(run, gate, lora_id)
    return run, victim, prompt, lora_id


def _assert_both_exact(run: Run, model_dir: Path, adapter: Path, victim: list[int], prompt: list[int]) -> None:
    """Both ended normally, the victim with the base model's tokens and "new" with PEFT's under the adapter."""
    assert run.ends == {"victim": "", "new": ""}
    assert run.tokens["new"] == peft_greedy(model_dir, adapter, prompt, MAX_TOKENS)[0]
    assert run.tokens["victim"] == peft_greedy(model_dir, None, victim, HELD_STEPS + MAX_TOKENS + 4)[0]


def _all_back(llm: LLM, worker_ids: set[int]) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == llm.engine.num_blocks
    assert llm.engine.scheduler.lora_not_ready == set()
    worker = llm.engine.executor.worker
    assert set(worker.runner.lora.host) == worker_ids and worker.lora_loads.pending == []


def test_the_step_loop_runs_the_victim_while_a_read_is_held_then_the_new_adapter_runs_exactly(adapters, gate) -> None:
    model_dir, dirs = adapters
    llm = _llm(model_dir)
    run, victim, prompt, lora_id = _victim_beside_a_held_load(llm, dirs["x"], gate, seed=71)
    worker = run.core.executor.worker
    assert "new" not in run.tokens and lora_id not in worker.runner.lora.host
    full = worker.cpu_threads
    assert worker._reading and (worker.governor is not None or torch.get_num_threads() == max(1, full - 1))
    gate.open()
    run.drain()
    assert not worker._reading and (worker.governor is not None or torch.get_num_threads() == full)
    _assert_both_exact(run, model_dir, dirs["x"], victim, prompt)
    _all_back(llm, {lora_id})
    run.core.shutdown()


def test_a_request_waiting_on_a_load_runs_once_it_is_read_even_with_nothing_else_running(adapters, gate) -> None:
    """No victim: the core polls with empty steps (each waits a little for the read), never spins, never
    deadlocks; base-model requests behind the waiting one are not held up."""
    model_dir, dirs = adapters
    llm = _llm(model_dir)
    run, registry = Run(llm), llm.engine.loras
    prompt, base = make_prompts(72, 2, 500, lo=9, hi=9)
    lora_id = registry.add("z", str(dirs["z"])).lora_id
    run.core.add_request(_request("new", prompt, "z"))
    run.core.add_request(_request("base", base, ""))
    for _ in range(3):
        run.step()
    assert "base" in run.tokens and "new" not in run.tokens
    gate.open()
    run.drain()
    assert run.tokens["new"] == peft_greedy(model_dir, dirs["z"], prompt, MAX_TOKENS)[0]
    assert run.ends == {"new": "", "base": ""}
    _all_back(llm, {lora_id})
    run.core.shutdown()


def test_unload_during_the_read_cancels_it_or_lets_its_waiting_request_finish_exactly(adapters, gate) -> None:
    model_dir, dirs = adapters
    llm = _llm(model_dir)
    run, registry = Run(llm), llm.engine.loras
    victim, prompt = make_prompts(73, 2, 500, lo=10, hi=10)
    run.core.add_request(_request("victim", victim, "", max_tokens=3 * HELD_STEPS + MAX_TOKENS))
    unused = registry.add("x", str(dirs["x"])).lora_id  # no request names it: the unload cancels the read
    run.step()
    assert unused in run.core.executor.worker.lora_loads.pending
    registry.remove("x")
    run.step()
    assert run.core.executor.worker.lora_loads.pending == [] and unused not in run.core.scheduler.lora_not_ready
    used = registry.add("z", str(dirs["z"])).lora_id  # its waiting request keeps it: it runs after the read
    run.core.add_request(_request("waiting", prompt, "z"))
    run.step()
    registry.remove("z")
    _hold_while_victim_runs(run, gate, used)
    gate.open()
    run.drain()
    assert run.ends == {"victim": "", "waiting": ""}
    assert run.tokens["waiting"] == peft_greedy(model_dir, dirs["z"], prompt, MAX_TOKENS)[0]
    run.core.add_request(_request("base", prompt, ""))  # one more step carries the drop
    run.drain()
    assert registry.served() == []
    _all_back(llm, set())
    run.core.shutdown()


def test_a_read_that_fails_ends_its_requests_with_an_error_and_unserves_the_name(adapters, gate, tmp_path) -> None:
    """The files change between the engine's validation and the workers' read (corrupt weights)."""
    import shutil

    model_dir, dirs = adapters
    llm = _llm(model_dir)
    run, registry = Run(llm), llm.engine.loras
    victim, prompt = make_prompts(74, 2, 500, lo=10, hi=10)
    run.core.add_request(_request("victim", victim, "", max_tokens=HELD_STEPS + MAX_TOKENS))
    copy = tmp_path / "x"
    shutil.copytree(dirs["x"], copy)
    lora_id = registry.add("x", str(copy)).lora_id
    changes: list[list[str]] = []  # what the engine server's WatchLoraAdapters would send (api/server.py)
    registry.on_change = lambda: changes.append([a.name for a in registry.served()])
    run.core.add_request(_request("doomed", prompt, "x"))
    run.step()
    (copy / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    gate.open()
    run.drain()
    assert run.ends["victim"] == ""
    assert run.ends["doomed"].startswith("lora_name: the engine's workers could not read LoRA adapter 'x'")
    assert "not a readable safetensors file" in run.ends["doomed"]
    assert "doomed" not in run.tokens and [a.name for a in registry.served()] == [] and changes == [[]]
    assert run.tokens["victim"] == peft_greedy(model_dir, None, victim, HELD_STEPS + MAX_TOKENS)[0]
    assert lora_id not in run.core.executor.worker.runner.lora.host
    registry.add("x", str(dirs["x"]))  # the name can be loaded again
    run.core.add_request(_request("again", prompt, "x"))
    run.drain()
    assert run.tokens["again"] == peft_greedy(model_dir, dirs["x"], prompt, MAX_TOKENS)[0]
    run.core.shutdown()


def test_replace_during_the_read_gives_each_request_the_weights_it_was_admitted_with(adapters, gate) -> None:
    model_dir, dirs = adapters
    llm = _llm(model_dir, max_loras=2)
    run, registry = Run(llm), llm.engine.loras
    prompt = make_prompts(75, 1, 500, lo=10, hi=10)[0]
    registry.add("a", str(dirs["x"]))
    run.core.add_request(_request("old", prompt, "a"))
    run.step()
    registry.add("a", str(dirs["z"]), replace=True)
    run.core.add_request(_request("new", prompt, "a"))
    run.step()
    gate.open()
    run.drain()
    assert run.tokens["old"] == peft_greedy(model_dir, dirs["x"], prompt, MAX_TOKENS)[0]
    assert run.tokens["new"] == peft_greedy(model_dir, dirs["z"], prompt, MAX_TOKENS)[0]
    assert run.ends == {"old": "", "new": ""}
    run.core.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tensor_parallel_a_request_waits_until_every_rank_holds_the_adapter(adapters, tmp_path, monkeypatch) -> None:
    """TP=2 over gloo: rank 0 reads at once, rank 1's read is held; the ranks' agreement keeps the request
    waiting (rank 0 alone would schedule it onto a rank without the adapter) while the victim runs."""
    model_dir, dirs = adapters
    monkeypatch.setenv(GATE_ENV, str(tmp_path / "gate-{rank}"))
    (tmp_path / "gate-0").touch()
    gate = Gate(tmp_path / "gate-1")
    llm = _llm(model_dir, tensor_parallel_size=2, device="cpu")
    run, victim, prompt, _ = _victim_beside_a_held_load(llm, dirs["x"], gate, seed=76)
    assert "new" not in run.tokens
    gate.open()
    run.drain()
    _assert_both_exact(run, model_dir, dirs["x"], victim, prompt)
    run.core.shutdown()
