"""Prefill/decode disaggregation: what moving K/V between engines costs and what it buys.

`--transfer`: one producer engine in this process (kv_producer); for each prompt length, prefill a prompt
there (max_tokens=1, keep the blocks), then pull its blocks over PullKvBlocks on loopback (the consumer's
own client, engine_svc/kv_transfer/puller.py) and time it against a plain memory copy of the same bytes.
Reports MB/s of both, their ratio, and the pull's time per 1,000 prompt tokens (what disaggregation adds
before the second token: the first comes from the prefill engine). Two copies are the reference:
`bytearray()` of the bytes (what earlier rounds reported; fresh 4 KiB pages, a page fault each) and a
copy into a fresh numpy array (numpy asks for transparent huge pages on large arrays, as the pull's own
buffers do), each timed right after its pull.

`--mix`: a decode stream's inter-token latency while long prompts arrive, unified vs disaggregated:
`--streams` short-prompt streams decode `--stream-tokens` tokens each while `--long` long prompts
(`--long-len` tokens, `--long-tokens` outputs) arrive every `--gap` seconds. Unified: one frontend over
one plain engine. Disaggregated: one frontend (`--routing pd`) over a kv_producer and a kv_consumer
engine. The two run alternately for `--rounds` rounds; medians and spreads over rounds. On a shared CPU
both engines compete for the same cores, so the disaggregated figures understate what separate machines
give (and the unified one runs on one engine's worth of threads).

    python bench/pd_disaggregation.py --model .tiny-models/SmolLM2-135M-Instruct --transfer --mix
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

import grpc  # noqa: E402
import numpy  # noqa: E402
from tandem.engine.v1 import engine_core_pb2 as epb  # noqa: E402
from tandem.v1 import generation_pb2 as pb  # noqa: E402
from tandem.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

from frontend_svc.client import generate_request  # noqa: E402
from tests.support import Service, free_port, wait_until  # noqa: E402

ENGINE_FLAGS = ("--dtype", "float32", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(512 << 20),
                "--metrics-port", "0", "--no-enable-prefix-caching")


# ---- transfer throughput -----------------------------------------------------------------------------
def transfer(model: Path, lengths: list[int], repeats: int, chunk_kib: int = 1024,
             producer_process: bool = False, side_channel: bool = False) -> None:
    from engine_svc.api.server import EngineServer
    from engine_svc.config import EngineConfig
    from engine_svc.kv_transfer.config import KVTransferConfig
    from engine_svc.kv_transfer.puller import KVPuller
    from shared_runtime.contract import KvTransferParams
    from tests.engine.test_engine_server import ServerThread
    from tests.engine_stream import EngineStream, engine_idle

    config = EngineConfig.create(model=str(model), dtype="float32", device="cpu", max_num_seqs=4,
                                 kv_cache_memory_bytes=512 << 20,
                                 kv_transfer_config=KVTransferConfig(kv_role="kv_producer",
                                                                     kv_chunk_bytes=chunk_kib << 10,
                                                                     kv_side_channel_port=0 if side_channel else -1))
    server = ServerThread(EngineServer(config, host="127.0.0.1", port=0)).start()
    wait_until(lambda: engine_idle(server.address), 120, "producer up", retry_on=(grpc.RpcError,))
    core = server.server.servicer.core  # type: ignore[union-attr]
    puller = KVPuller(core.kv_connector.layout, timeout_s=60, max_message_bytes=64 << 20)
    address, port = server.address, server.server.bound_port
    logs = tempfile.TemporaryDirectory()
    remote = None
    if producer_process:  # the same producer in a process of its own: the two ends share no GIL
        port = free_port()
        kv = json.dumps({"kv_role": "kv_producer", "kv_chunk_bytes": chunk_kib << 10,
                         "kv_side_channel_port": 0 if side_channel else -1})
        remote = Service("producer", [sys.executable, "-m", "engine_svc.cli", "--model", str(model), "--host",
                                      "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-num-seqs", "4",
                                      "--kv-cache-memory-bytes", str(512 << 20), "--metrics-port", "0",
                                      "--kv-transfer-config", kv], port, Path(logs.name)).start()
        remote.wait_serving()
        address = remote.address
    rng = random.Random(0)
    vocab = min(40000, json.loads((model / "config.json").read_text()).get("vocab_size", 40000))
    print(f"block: {puller.layout.block_bytes / 1024:.0f} KiB over {puller.layout.num_layers} layers; "
          f"chunks of {config.kv_transfer_config.kv_chunk_bytes >> 10} KiB; "  # type: ignore[union-attr]
          f"{'gRPC stream and side channel, alternated' if side_channel else 'in the gRPC stream'}")
    modes = ("grpc", "side") if side_channel else ("grpc",)  # side: alternated with grpc, pull by pull
    for length in lengths:
        pulls: dict[str, list[float]] = {m: [] for m in modes}
        ratios: dict[str, list[float]] = {m: [] for m in modes}  # memcpy time / pull time, measured back to back
        ratios_np: dict[str, list[float]] = {m: [] for m in modes}  # the same against a copy into numpy memory
        nbytes = 0
        for r, mode in itertools.product(range(repeats), modes):
            rid = f"t{length}-{r}-{mode}"
            with grpc.insecure_channel(address) as channel:
                stream = EngineStream(channel)
                stream.send(epb.EngineCoreRequest(
                    request_id=rid, prompt_token_ids=[rng.randrange(vocab // 4, vocab) for _ in range(length)],
                    sampling_params=epb.EngineSamplingParams(temperature=0, max_tokens=1),
                    kv_transfer_params=epb.KvTransferParams(do_remote_decode=True)))
                stream.wait_finished(rid, timeout=300)
                stream.close()
            params = KvTransferParams(remote_host="127.0.0.1", remote_port=port, remote_request_id=rid)
            puller.offer_side_channel = mode == "side"
            start = time.perf_counter()
            result = puller.pull_now(rid, params, 0)
            pull = time.perf_counter() - start
            assert result.data is not None, result.error
            data = result.data
            nbytes = len(data)
            start = time.perf_counter()
            bytearray(data)  # a plain copy of the same bytes
            copy = time.perf_counter() - start
            start = time.perf_counter()
            numpy.copyto(numpy.empty(nbytes, dtype=numpy.uint8), numpy.frombuffer(data, dtype=numpy.uint8))
            copy_np = time.perf_counter() - start
            pulls[mode].append(pull)
            ratios[mode].append(copy / pull)
            ratios_np[mode].append(copy_np / pull)
        for mode in modes:
            pull = statistics.median(pulls[mode])
            print(f"prompt {length:5d} tokens, {nbytes / 2**20:7.1f} MiB, {mode:4s}: pull "
                  f"{nbytes / pull / 2**20:7.0f} MiB/s ({pull * 1000:6.1f} ms, spread "
                  f"{min(pulls[mode]) * 1000:.1f}-{max(pulls[mode]) * 1000:.1f}); pull/memcpy median "
                  f"{statistics.median(ratios[mode]):5.1%} (spread {min(ratios[mode]):.1%}-{max(ratios[mode]):.1%}), "
                  f"pull/numpy copy {statistics.median(ratios_np[mode]):5.1%} "
                  f"(spread {min(ratios_np[mode]):.1%}-{max(ratios_np[mode]):.1%}); "
                  f"{pull * 1000 / length * 1000:6.1f} ms per 1,000 tokens")
    if remote is not None:
        remote.stop()
    logs.cleanup()
    server.begin_drain()
    server.join(30)


# ---- long prompts vs decode streams --------------------------------------------------------------------
def _engine(model: Path, log_dir: Path, *flags: str) -> Service:
    port = free_port()
    argv = [sys.executable, "-m", "engine_svc.cli", "--model", str(model), "--host", "127.0.0.1", "--port",
            str(port), *ENGINE_FLAGS, *flags]
    return Service("engine", argv, port, log_dir).start()


def _frontend(model: Path, log_dir: Path, engines: list[Service], routing: str) -> Service:
    port = free_port()
    argv = [sys.executable, "-m", "frontend_svc.cli", "--model", str(model), "--host", "127.0.0.1", "--port",
            str(port), "--engine", ",".join(e.address for e in engines), "--metrics-port", "0", "--routing", routing,
            "--max-concurrent-requests", "128"]
    return Service("frontend", argv, port, log_dir).start()


def _stream_times(api: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest) -> list[float]:
    """Arrival time of each response carrying tokens, from the call's start (index 0)."""
    start = time.perf_counter()
    times = [start]
    for response in api.Generate(request, timeout=600):
        if response.token_ids:
            times.append(time.perf_counter())
    return times


def mix_round(api: pb_grpc.GenerationServiceStub, args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    streams = [generate_request(token_ids=[rng.randrange(100, 40000) for _ in range(32)], temperature=0.0,
                                max_tokens=args.stream_tokens, ignore_eos=True) for _ in range(args.streams)]
    longs = [generate_request(token_ids=[rng.randrange(100, 40000) for _ in range(args.long_len)], temperature=0.0,
                              max_tokens=args.long_tokens, ignore_eos=True) for _ in range(args.long)]
    results: dict[str, list[list[float]]] = {"stream": [], "long": []}
    lock = threading.Lock()

    def run(kind: str, request: pb.GenerateRequest) -> None:
        times = _stream_times(api, request)
        with lock:
            results[kind].append(times)

    threads = [threading.Thread(target=run, args=("stream", r)) for r in streams]
    for t in threads:
        t.start()
    time.sleep(args.gap)
    for r in longs:
        t = threading.Thread(target=run, args=("long", r))
        t.start()
        threads.append(t)
        time.sleep(args.gap)
    for t in threads:
        t.join()
    gaps = [b - a for times in results["stream"] for a, b in itertools.pairwise(times[2:])]  # decode gaps
    ttft = [times[1] - times[0] for times in results["long"]]
    second = [times[2] - times[1] for times in results["long"] if len(times) > 2]
    return {"itl_p50": statistics.median(gaps), "itl_p90": statistics.quantiles(gaps, n=10)[-1], "itl_max": max(gaps),
            "long_ttft_p50": statistics.median(ttft), "long_token2_p50": statistics.median(second)}


def mix(model: Path, args: argparse.Namespace) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    kv = lambda role: json.dumps({"kv_connector": "GrpcConnector", "kv_role": role})  # noqa: E731
    plain = _engine(model, log_dir)
    producer = _engine(model, log_dir, "--kv-transfer-config", kv("kv_producer"))
    consumer = _engine(model, log_dir, "--kv-transfer-config", kv("kv_consumer"))
    services = [plain, producer, consumer]
    try:
        for e in services:
            e.wait_serving(300)
        fronts = {"unified": _frontend(model, log_dir, [plain], "least-load"),
                  "disaggregated": _frontend(model, log_dir, [producer, consumer], "pd")}
        services += fronts.values()
        apis = {}
        for name, f in fronts.items():
            f.wait_serving(120)
            apis[name] = pb_grpc.GenerationServiceStub(grpc.insecure_channel(f.address))
        want = {"unified": 1, "disaggregated": 2}
        for name, api in apis.items():
            wait_until(lambda a=api, n=name: a.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_ready_engines == want[n],
                       60, f"{name} ready")
        figures: dict[str, list[dict[str, float]]] = {name: [] for name in apis}
        for r in range(args.rounds):
            for name in (list(apis) if r % 2 == 0 else list(apis)[::-1]):
                figures[name].append(mix_round(apis[name], args, random.Random(r)))
                print(f"round {r} {name}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in figures[name][-1].items()),
                      flush=True)
        print(f"\n{args.streams} streams x {args.stream_tokens} tokens; {args.long} prompts of {args.long_len} tokens "
              f"every {args.gap:g} s; {args.rounds} rounds alternating (medians over rounds, [min-max])")
        for key in figures["unified"][0]:
            u = [f[key] for f in figures["unified"]]
            d = [f[key] for f in figures["disaggregated"]]
            print(f"{key:16s} unified {statistics.median(u) * 1000:7.0f} ms [{min(u) * 1000:.0f}-{max(u) * 1000:.0f}]"
                  f"  disaggregated {statistics.median(d) * 1000:7.0f} ms [{min(d) * 1000:.0f}-{max(d) * 1000:.0f}]"
                  f"  ratio d/u {statistics.median(d) / statistics.median(u):.2f}")
    finally:
        for s in reversed(services):
            s.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--transfer", action="store_true")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-kib", type=int, default=1024, help="the producer's kv_chunk_bytes, in KiB")
    p.add_argument("--side-channel", action="store_true",
                   help="--transfer: the producer has a TCP side channel (kv_side_channel_port 0); pulls alternate "
                        "between the gRPC stream and the side channel")
    p.add_argument("--producer-process", action="store_true",
                   help="pull from a producer engine in a process of its own (default: in this process)")
    p.add_argument("--mix", action="store_true")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--long", type=int, default=3)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=8)
    p.add_argument("--gap", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if args.transfer:
        transfer(args.model, args.lengths, args.repeats, args.chunk_kib, args.producer_process, args.side_channel)
    if args.mix:
        mix(args.model, args)


if __name__ == "__main__":
    main()
