"""The offline, in-process API: `LLM(model=DIR or X.gguf).generate(prompts, SamplingParams(...))`, and
`LLM.chat(messages, ...)` for chat conversations rendered with the model's chat template.

This is the only engine module that composes frontend_svc's processing (tokenize, validate,
detokenize, stop strings) with an in-process EngineCore. The loop is exactly what the split does over
gRPC, with the same objects: the processor's `EngineCoreRequest`s (shared_runtime/contract.py) go to
the core as they are; each step's `EngineCoreOutputs` reaches the output processor in the one shape it
reads, protobuf (converted as the engine service does, shared_runtime/to_pb.py); stop-string matches
become engine aborts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.outputs import RequestOutput, RequestOutputAccumulator
from frontend_svc.processor import ChatPrompt, PreparedRequest, Processor
from frontend_svc.tokenizer import Tokenizer
from shared_runtime.contract import LoRARequest, SamplingParams
from shared_runtime.to_pb import outputs_to_pb

Prompt = str | list[int] | ChatPrompt
Conversation = Sequence[Mapping[str, str]]


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        self.config = EngineConfig.create(model=model, **engine_args)
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.engine = EngineCore(self.config)
        # The engine's max_model_len: the configured one, or less when the KV cache holds fewer tokens.
        self.processor = Processor(self.tokenizer, max_model_len=self.engine.max_model_len,
                                   vocab_size=self.engine.vocab_size, model_name=self.config.model_name)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        `priority` (one per prompt, lower runs first) matters under scheduling_policy="priority".
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model).
        """
        prompt_list = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        loras = self._lora_names(lora_request, len(prompt_list))
        # Validate every prompt before submitting any, so a bad one leaves nothing behind in the engine.
        prepared = [self._prepare(prompt, p, prio) for prompt, p, prio in zip(prompt_list, params, priorities)]
        for request, lora_name in zip(prepared, loras):
            request.lora_name = lora_name
        acc = RequestOutputAccumulator()
        for prompt, request in zip(prompt_list, prepared):
            self._submit(request)
            acc.add_request(request, prompt if isinstance(prompt, str) else None)
        self._run(acc, len(prepared), use_tqdm)
        return [acc.get(request.request_id) for request in prepared]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role": ..., "content": ...} dicts) or a list
        of them, each rendered with the model's chat template; outputs come back in input order."""
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if single else messages
        prompts: list[Prompt] = [
            ChatPrompt([dict(m) for m in conv], add_generation_prompt)  # type: ignore[union-attr]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _as_prompt_list(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, (str, ChatPrompt)):
            return [prompts]
        if prompts and isinstance(prompts, list) and all(isinstance(t, int) for t in prompts):
            return [prompts]  # type: ignore[list-item]
        return list(prompts)  # type: ignore[arg-type]

    @staticmethod
    def _as_params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts; pass one, or one per prompt")
        return list(sp)

    def _lora_names(self, lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[str]:
        """Each prompt's adapter name ("" = base), checked against the adapters the engine serves."""
        loras = [lora] * n if lora is None or isinstance(lora, LoRARequest) else list(lora)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora requests for {n} prompts; pass one, or one per prompt")
        for item in loras:
            if item is not None and item.lora_path:
                self._load_lora(item)
        registry = self.engine.loras
        served = {a.name: (a.lora_id, a.path) for a in registry.served()} if registry is not None else {}
        for item in loras:
            if item is None:
                continue
            if item.lora_name not in served:
                raise ValueError(f"lora_request: unknown LoRA adapter {item.lora_name!r}; this engine serves "
                                 f"{', '.join(served) or 'none (start it with enable_lora and lora_modules)'}")
            lora_id, path = served[item.lora_name]
            if (not item.lora_path and item.lora_int_id not in (0, lora_id)) or item.lora_path not in ("", path):
                raise ValueError(f"lora_request {item.lora_name!r}: lora_int_id / lora_path differ from the "
                                 f"served adapter's ({lora_id}, {path!r})")
        return [item.lora_name if item is not None else "" for item in loras]

    def _load_lora(self, request: LoRARequest) -> None:
        """vLLM's offline semantics: a LoRARequest with a path the engine does not serve under that name is
        loaded (validated first: LoRAAdapterError names the problem and nothing changes)."""
        from engine_svc.lora.peft_dir import validate_for_model

        registry, cfg = self.engine.loras, self.config
        if registry is None:
            raise ValueError("lora_request: LoRA is not enabled (create the LLM with enable_lora=True)")
        if any(a.name == request.lora_name and a.path == request.lora_path for a in registry.served()):
            return
        validate_for_model(cfg.model, cfg.architecture, cfg.max_lora_rank, request.lora_name, request.lora_path)
        registry.add(request.lora_name, request.lora_path, replace=True)

    def _prepare(self, prompt: Prompt, params: SamplingParams, priority: int = 0) -> PreparedRequest:
        request_id = str(self._counter)
        self._counter += 1
        return self.processor.process(prompt, params, request_id=request_id, priority=priority)

    def _submit(self, prepared: PreparedRequest) -> None:
        self.output_processor.add_request(prepared)
        for request in self.processor.engine_requests(prepared):
            self.engine.add_request(request)

    def _run(self, acc: RequestOutputAccumulator, num_requests: int, use_tqdm: bool) -> None:
        bar = _ProgressBar(num_requests) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            if not self.engine.has_work():  # only grammars compiling: wait for one instead of spinning
                self.engine.wait_for_work(0.1)
                continue
            processed = self.output_processor.process_outputs(outputs_to_pb(self.engine.step()))
            if processed.reqs_to_abort:
                self.engine.abort_requests(processed.reqs_to_abort)
            for delta in processed.deltas:
                done = acc.add_delta(delta)
                if bar is not None:
                    bar.update(delta, done)
        if bar is not None:
            bar.close()


class _ProgressBar:
    """vLLM-style progress: finished requests, with input and output tokens/s in the postfix."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.start = time.perf_counter()
        self.in_tokens = 0
        self.out_tokens = 0

    def update(self, delta: Any, request_done: bool) -> None:
        self.out_tokens += len(delta.token_ids)
        if delta.usage is not None:
            self.in_tokens += delta.usage.prompt_tokens
        if request_done:
            elapsed = time.perf_counter() - self.start
            self.bar.postfix = (f"est. speed input: {self.in_tokens / elapsed:.2f} toks/s, "
                                f"output: {self.out_tokens / elapsed:.2f} toks/s")
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
