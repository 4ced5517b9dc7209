"""Where a served request's TTFT goes, in engine steps: the real scheduler (engine_svc/sched/scheduler.py)
under a closed-loop client shaped like `vllm bench serve` (N prompts, at most C in flight, a new one sent
as soon as one ends; random-token prompts, ignore_eos), with a fake model that samples a token wherever
a request reaches its last one. No forward pass runs, so the figures are step counts, not seconds: how
many steps a prompt waits for its first token, how many steps carry prefill, and how big those are.

    python bench/step_policy.py --policies 256:64 512:256 2048:256 2048:0

A policy is BUDGET:THRESHOLD (--max-num-batched-tokens : --long-prefill-token-threshold). Workloads as in
bench/vs_vllm.py's served mode: `bench` 256 in / 128 out, `mix` prompt and output lengths uniform in
[16, 255]."""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

from engine_svc.request import Request
from engine_svc.sched.output import ModelRunnerOutput
from engine_svc.sched.scheduler import Scheduler
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

Lengths = Callable[[random.Random], tuple[int, int]]
WORKLOADS: dict[str, Lengths] = {
    "bench": lambda rng: (256, 128),
    "mix": lambda rng: (rng.randint(16, 255), rng.randint(16, 255)),
}
MAX_MODEL_LEN = 4096


def simulate(budget: int, threshold: int, concurrency: int, num_prompts: int, lengths: Lengths,
             seed: int = 0) -> dict[str, float]:
    """Run the closed loop to the end; returns TTFT in steps (median, mean, max), the step count, the share
    of steps that carry prefill and the median size of those steps in tokens."""
    sched = Scheduler(max_num_seqs=max(256, concurrency), max_num_batched_tokens=budget,
                      max_model_len=MAX_MODEL_LEN, block_size=16, num_blocks=1 + num_prompts * 32,
                      long_prefill_token_threshold=threshold)
    rng = random.Random(seed)
    sent_at: dict[str, int] = {}
    ttft: list[int] = []
    first_token: set[str] = set()
    prefill_steps: list[int] = []
    steps = done = 0

    def send() -> None:
        prompt_len, output_len = lengths(rng)
        rid = f"r{len(sent_at)}"
        core = EngineCoreRequest(request_id=rid, prompt_token_ids=[rng.randrange(3, 30000) for _ in range(prompt_len)],
                                 sampling_params=EngineSamplingParams(max_tokens=output_len, ignore_eos=True),
                                 arrival_time=float(len(sent_at)))
        sent_at[rid] = steps
        sched.add_request(Request(core, MAX_MODEL_LEN))

    for _ in range(min(concurrency, num_prompts)):
        send()
    while done < num_prompts:
        so = sched.schedule()
        steps += 1
        counts = so.num_scheduled_tokens
        if any(sched.requests[r].num_computed_tokens - n < sched.requests[r].num_prompt_tokens for r, n in counts.items()):
            prefill_steps.append(sum(counts.values()))
        sampled = [7 if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens else -1 for r in counts]
        out = sched.update_from_output(so, ModelRunnerOutput(req_ids=list(counts), sampled_token_ids=sampled))
        for o in out.outputs:
            if o.new_token_ids and o.request_id not in first_token:
                first_token.add(o.request_id)
                ttft.append(steps - sent_at[o.request_id])
            if o.finished:
                done += 1
                if len(sent_at) < num_prompts:
                    send()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and len(ttft) == num_prompts
    return {"steps": steps, "ttft_median": statistics.median(ttft), "ttft_mean": statistics.mean(ttft),
            "ttft_max": max(ttft), "prefill_share": len(prefill_steps) / steps,
            "prefill_step_median": statistics.median(prefill_steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["256:64", "512:256", "2048:256", "2048:0"],
                    help="BUDGET:THRESHOLD pairs")
    ap.add_argument("--cases", nargs="+", default=["bench:16", "bench:64", "mix:16"],
                    help=f"WORKLOAD:CONCURRENCY pairs (workloads: {', '.join(WORKLOADS)})")
    ap.add_argument("--num-prompts", type=int, default=64)
    args = ap.parse_args()
    print("| workload | concurrency | budget:threshold | steps | TTFT steps median / mean / max "
          "| steps with prefill | prefill step median tokens |")
    print("|---|---|---|---|---|---|---|")
    for case in args.cases:
        workload, concurrency = case.split(":")
        if workload not in WORKLOADS:
            ap.error(f"--cases: unknown workload {workload!r} (one of {', '.join(WORKLOADS)})")
        for policy in args.policies:
            budget, threshold = (int(x) for x in policy.split(":"))
            r = simulate(budget, threshold, int(concurrency), args.num_prompts, WORKLOADS[workload])
            print(f"| {workload} | {concurrency} | {budget}:{threshold} | {r['steps']:.0f} | {r['ttft_median']:g} / "
                  f"{r['ttft_mean']:.1f} / {r['ttft_max']:.0f} | {100 * r['prefill_share']:.0f}% | "
                  f"{r['prefill_step_median']:g} |", flush=True)


if __name__ == "__main__":
    main()
