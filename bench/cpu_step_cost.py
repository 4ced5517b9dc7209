"""What a prefill chunk costs the streams it joins: engine step times on CPU, in process, by chunk size.

16 requests decode (the served benchmark's concurrency and, by default, its 256-token prompts: the
decode step reads their context); a prompt of `--prompt` tokens then arrives and
is prefilled `chunk` tokens a step beside them (the scheduler's long_prefill_token_threshold), for each
chunk size asked. Printed per chunk: the decode-only step (median of the steps before the prompt), the
steps that carry a chunk (median, max), their count, and the prompt's time to first token. A decoding
stream's inter-token gap is the step time, so "chunk step / decode step" is what one prefill chunk adds
to every stream's gap, and (steps carrying chunks) x (their extra time) is what the prompt costs them.
The streams decode greedily unless `--temperature` says otherwise; the served benchmark's requests sample
(temperature 1.0), so its twin here is `--temperature 1`.

    python bench/cpu_step_cost.py --model .tiny-models/SmolLM2-135M-Instruct --dtype bfloat16 \
        --chunks 64 128 256 --prompt 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

DECODERS = 16


def _step_times(core: EngineCore, until: str | None, n: int) -> tuple[list[float], float]:
    """Step until `until` samples its first token (or `n` steps when None): step durations, elapsed."""
    times: list[float] = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        outputs = core.step()
        times.append(time.perf_counter() - t0)
        if until is None and len(times) == n:
            break
        if until is not None and any(o.request_id == until and o.new_token_ids for o in outputs.outputs):
            break
    return times, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--prompt", type=int, default=256, help="tokens of the arriving prompt")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the decoding streams' temperature (0: greedy; `vllm bench serve` sends none, so "
                         "served streams sample at 1.0)")
    args = ap.parse_args()
    budget = max(args.chunks) + DECODERS
    config = EngineConfig.create(model=args.model, dtype=args.dtype, device="cpu", max_model_len=4096,
                                 max_num_batched_tokens=max(budget, 256), long_prefill_token_threshold=0)
    core = EngineCore(config)
    rng = random.Random(0)
    params = EngineSamplingParams(temperature=args.temperature, max_tokens=3000, ignore_eos=True)
    for i in range(DECODERS):
        prompt = [rng.randrange(100, 40000) for _ in range(args.context)]
        core.add_request(EngineCoreRequest(request_id=f"d{i}", prompt_token_ids=prompt, sampling_params=params))
    _step_times(core, None, 2 * DECODERS)  # the decoders' prefill and warm-up
    print(f"{args.dtype}, {DECODERS} streams decoding ({args.context}-token prompts), "
          f"a {args.prompt}-token prompt arriving")
    print("| round | chunk | decode step ms | chunk step ms (median / max) | chunk steps | prompt TTFT ms |")
    print("|---|---|---|---|---|---|")
    for rnd in range(1, args.rounds + 1):
        for chunk in args.chunks:
            core.scheduler.long_prefill_token_threshold = chunk
            decode, _ = _step_times(core, None, 10)
            rid = f"p{rnd}-{chunk}"
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt)]
            core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                                               sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=1)))
            steps, ttft = _step_times(core, rid, 0)
            print(f"| {rnd} | {chunk} | {statistics.median(decode) * 1e3:.1f} | "
                  f"{statistics.median(steps) * 1e3:.1f} / {max(steps) * 1e3:.1f} | {len(steps)} | "
                  f"{ttft * 1e3:.0f} |", flush=True)
    core.shutdown()


if __name__ == "__main__":
    main()
