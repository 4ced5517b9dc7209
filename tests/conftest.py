"""Suite-wide fixtures: tiny random-weight models built locally (nothing can be downloaded).

Triton kernels run on CPU through the interpreter, which must be switched on before triton is
imported anywhere in the process.

The suite runs in random order (pytest-randomly, from the dev extra: modules, then tests within them,
shuffled from one seed; `random` and numpy reseeded per test). The seed is printed at the end of every
run, -q included: `-p randomly --randomly-seed=N` replays an order, `-p no:randomly` runs in file order.
Shared helpers (waiting, ports, health, a client with deadlines, service processes) are in tests/support.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CPU worker's thread governor (engine_svc/worker/cpu_threads.py) resizes the OpenMP team when other
# processes take cores; a team of another size rounds differently, and the suite compares runs token for
# token while its own processes load the machine. Its tests turn it on where they test it.
os.environ.setdefault("TANDEM_CPU_THREAD_GOVERNOR", "0")
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Small, but with enough heads for GQA; qwen2 is MQA (one KV head); qwen3 has head_dim != hidden/heads.
TINY_SHAPES: dict[str, dict[str, int]] = {
    "llama": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2),
    "mistral": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2),
    "qwen2": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1),
    "qwen3": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32),
}


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def make_model(tiny_model_root: Path):
    """Build (once per session) a tiny model of an architecture; returns its directory."""
    from entrypoints.tiny_model import make_tiny_model

    cache: dict[tuple, Path] = {}

    def build(arch: str = "llama", seed: int = 0, **overrides: int) -> Path:
        shape = {**TINY_SHAPES[arch], **overrides}
        key = (arch, seed, tuple(sorted(shape.items())))
        if key not in cache:
            name = f"{arch}-{seed}-" + "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
            cache[key] = make_tiny_model(tiny_model_root / name, arch=arch, seed=seed, vocab_size=512, **shape)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def llama_dir(make_model) -> Path:
    return make_model("llama")


@pytest.fixture(scope="session")
def tiny_model_dir(make_model) -> Path:
    """The tiny llama the frontend-side tests serve (its tokenizer is `tokenizer`)."""
    return make_model("llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from frontend_svc.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def loop():
    """An asyncio loop on a daemon thread for servers run in the test process (tests/support.py)."""
    from tests.support import LoopThread

    thread = LoopThread()
    yield thread
    thread.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    """Name the random order's seed (the header that pytest-randomly writes is hidden under -q)."""
    seed = config.getoption("randomly_seed", default=None)
    if not isinstance(seed, int) or not config.getoption("randomly_reorganize", default=False):
        return
    outcome = "FAILED" if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) else "ran"
    terminalreporter.write_line(f"random test order {outcome} with seed {seed}: rerun this order with "
                                f"-p randomly --randomly-seed={seed}")
