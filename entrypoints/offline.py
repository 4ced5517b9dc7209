"""`tandem offline`: run a few prompts through the in-process engine and print the completions."""

from __future__ import annotations

import argparse
import time

from engine_svc.config import add_engine_args

DEFAULT_PROMPTS = [
    "The engine schedules requests",
    "Once upon a time, in a small town by the sea,",
    "def fibonacci(n):",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem offline", description=__doc__)
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three demo prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)

    from engine_svc.config import config_from_args
    from entrypoints.llm import LLM
    from shared_runtime.contract import SamplingParams

    cfg = config_from_args(args)
    engine_args = {k: v for k, v in vars(cfg).items() if k not in ("model", "architecture", "model_dtype")}
    t0 = time.perf_counter()
    llm = LLM(cfg.model, **engine_args)
    print(f"loaded {cfg.model_name} ({cfg.architecture}, {cfg.torch_dtype_name} on {cfg.device}) "
          f"in {time.perf_counter() - t0:.2f}s; {llm.engine.num_blocks} KV blocks")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outputs = llm.generate(args.prompt or DEFAULT_PROMPTS, params)
    elapsed = time.perf_counter() - t0
    total = 0
    for out in outputs:
        comp = out.outputs[0]
        total += len(comp.token_ids)
        print(f"\n--- {out.prompt!r}\n{comp.text!r}\n    [{len(comp.token_ids)} tokens, "
              f"finish={comp.finish_reason}, cached prompt tokens={out.num_cached_tokens}]")
    print(f"\n{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)")
    return 0
