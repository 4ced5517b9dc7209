"""tandem's engine: scheduler, KV cache, workers and models; plus the offline `LLM` API.

`from engine_svc import LLM, SamplingParams` is the in-process entry point. Both names are resolved
lazily so that importing a submodule (e.g. the scheduler) does not load torch or the tokenizer.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine_svc.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shared_runtime.contract import SamplingParams

        return SamplingParams
    raise AttributeError(name)
