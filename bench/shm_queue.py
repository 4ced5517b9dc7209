"""Per-step broadcast latency: SchedulerOutput to every TP worker and rank 0's answer back.

One "step" is what MultiprocExecutor.execute_model does around the forward pass: the engine encodes a
typical decode SchedulerOutput (64 running requests, one new token and the odd new block each), every
reader process decodes it, reader 0 encodes a 64-token ModelRunnerOutput and the engine decodes it.
The forward itself is not included. Transports compared:

    shm+msgspec      the broadcast ring buffer (msgspec) and a 1-reader shm queue back   (what tandem uses)
    shm+msgspec/pipe the broadcast ring buffer, answer over a pipe
    shm+pickle       the ring buffer carrying pickle
    pipe+pickle      one multiprocessing Pipe per reader, pickle both ways              (the baseline)

    python bench/shm_queue.py [--steps 2000] [--readers 1 2]

Numbers depend heavily on free cores: with more busy processes than cores the sleeping waiters'
wake-up latency dominates.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_svc.executor import codec
from engine_svc.executor.shm_queue import ShmBroadcastQueue
from engine_svc.sched.output import CachedRequestData, ModelRunnerOutput, SchedulerOutput

MODES = ("shm+msgspec", "shm+msgspec/pipe", "shm+pickle", "pipe+pickle")


def decode_step(num_reqs: int = 64, step: int = 0) -> SchedulerOutput:
    cached = [
        CachedRequestData(
            req_id=f"req-{i:05d}",
            new_token_ids=[1000 + step + i],
            new_block_ids=[step * num_reqs + i] if (step + i) % 16 == 0 else [],
            num_computed_tokens=200 + step,
        )
        for i in range(num_reqs)
    ]
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={c.req_id: 1 for c in cached},
        total_num_scheduled_tokens=num_reqs,
    )


def answer_for(so: SchedulerOutput) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=list(range(len(ids))))


def reader_main(mode: str, rank: int, cmd, resp, steps: int, work_s: float) -> None:
    use_pickle = "pickle" in mode
    if mode.startswith("shm"):
        cmd_q = ShmBroadcastQueue.attach_reader(cmd)
        decode = pickle.loads if use_pickle else codec.decode_scheduler_output
        recv = lambda: cmd_q.dequeue(decode=decode)  # noqa: E731
    else:
        recv = lambda: pickle.loads(cmd.recv_bytes())  # noqa: E731
    if rank != 0:
        send = None
    elif mode == "shm+msgspec":
        resp_q = ShmBroadcastQueue.attach_writer(resp)
        send = lambda out: resp_q.enqueue(codec.encode_runner_output(out))  # noqa: E731
    elif mode == "shm+msgspec/pipe":
        send = lambda out: resp.send_bytes(codec.encode_runner_output(out))  # noqa: E731
    else:
        send = lambda out: resp.send_bytes(pickle.dumps(out, protocol=5))  # noqa: E731
    for _ in range(steps):
        so = recv()
        if work_s:
            time.sleep(work_s)  # a forward pass that waits on the GPU
        if send is not None:
            send(answer_for(so))


def run_mode(mode: str, n_readers: int, steps: int, warmup: int, work_s: float) -> list[float]:
    ctx = mp.get_context("spawn")
    total = steps + warmup
    cmd_q = resp_q = None
    if mode.startswith("shm"):
        cmd_q = ShmBroadcastQueue.create(n_readers, max_chunks=4, max_chunk_bytes=1 << 20)
        cmd_handles = [cmd_q.reader_handle(r) for r in range(n_readers)]
    else:
        pipes = [ctx.Pipe(duplex=False) for _ in range(n_readers)]
        cmd_handles = [r for r, _ in pipes]
    if mode == "shm+msgspec":
        resp_q = ShmBroadcastQueue.create(1, max_chunks=2, max_chunk_bytes=1 << 20, owner_is_writer=False)
        resp_handle = resp_q.writer_handle()
    else:
        resp_recv, resp_handle = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(
            target=reader_main, args=(mode, r, cmd_handles[r], resp_handle if r == 0 else None, total, work_s)
        )
        for r in range(n_readers)
    ]
    for p in procs:
        p.start()
    if cmd_q is not None:
        cmd_q.release_peer_ends()
    if resp_q is not None:
        resp_q.release_peer_ends()

    use_pickle = "pickle" in mode
    encode = (lambda so: pickle.dumps(so, protocol=5)) if use_pickle else codec.encode_scheduler_output
    if cmd_q is not None:
        broadcast = cmd_q.enqueue
    else:

        def broadcast(data: bytes) -> None:
            for _, send_end in pipes:
                send_end.send_bytes(data)

    if resp_q is not None:
        receive = lambda: resp_q.dequeue(decode=codec.decode_runner_output)  # noqa: E731
    elif use_pickle:
        receive = lambda: pickle.loads(resp_recv.recv_bytes())  # noqa: E731
    else:
        receive = lambda: codec.decode_runner_output(resp_recv.recv_bytes())  # noqa: E731

    sos = [decode_step(step=i) for i in range(16)]
    times = []
    for i in range(total):
        so = sos[i % len(sos)]
        t0 = time.perf_counter()
        broadcast(encode(so))
        out = receive()
        t1 = time.perf_counter()
        assert len(out.sampled_token_ids) == 64
        if i >= warmup:
            times.append((t1 - t0) * 1e6)
    for p in procs:
        p.join(10)
    for q in (cmd_q, resp_q):
        if q is not None:
            q.close()
    return times


def codec_costs(n: int = 2000) -> dict[str, float]:
    so = decode_step()
    enc_m = codec.encode_scheduler_output(so)
    enc_p = pickle.dumps(so, protocol=5)

    def per_call(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    return {
        "msgspec encode": per_call(lambda: codec.encode_scheduler_output(so)),
        "msgspec decode": per_call(lambda: codec.decode_scheduler_output(enc_m)),
        "pickle encode": per_call(lambda: pickle.dumps(so, protocol=5)),
        "pickle decode": per_call(lambda: pickle.loads(enc_p)),
        "msgspec bytes": len(enc_m),
        "pickle bytes": len(enc_p),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--work-us",
        type=float,
        nargs="+",
        default=[0, 2000],
        help="simulated forward time per step (reported latency excludes it)",
    )
    args = parser.parse_args()

    costs = codec_costs()
    print(
        "SchedulerOutput, 64 decode requests: "
        + ", ".join(f"{k} {v:.0f}" + ("" if "bytes" in k else " us") for k, v in costs.items())
    )
    print("latency per step in us, excluding the simulated forward time")
    print(f"{'transport':<18}{'readers':>8}{'fwd us':>8}{'p50':>9}{'p90':>9}{'p99':>9}{'mean':>9}")
    for work_us in args.work_us:
        steps = args.steps if work_us == 0 else max(100, min(args.steps, int(2e6 / work_us)))
        for n_readers in args.readers:
            for mode in args.modes:
                t = sorted(
                    x - work_us for x in run_mode(mode, n_readers, steps, args.warmup // 4, work_us / 1e6)
                )
                p50, p90, p99 = (t[min(len(t) - 1, int(f * len(t)))] for f in (0.5, 0.9, 0.99))
                print(
                    f"{mode:<18}{n_readers:>8}{work_us:>8.0f}{p50:>9.1f}{p90:>9.1f}{p99:>9.1f}"
                    f"{statistics.fmean(t):>9.1f}"
                )


if __name__ == "__main__":
    main()
