"""What composes the two services: the `tandem` command (serve, generate, offline, make-*) and the offline
in-process API.

`from entrypoints import LLM, SamplingParams` is the offline API (vLLM's `from vllm import LLM,
SamplingParams`). Both names are resolved lazily, so that importing the command-line glue does not load
torch or the tokenizer. This is the only package that imports both `engine_svc` and `frontend_svc`.
"""

from typing import Any

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shared_runtime.contract import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from shared_runtime.contract import LoRARequest

        return LoRARequest
    raise AttributeError(name)
