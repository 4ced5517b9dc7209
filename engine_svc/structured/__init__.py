"""Structured outputs: the engine enforces a grammar per request (JSON schema, JSON object, regex, choice,
EBNF grammar, structural tag) with xgrammar, as vLLM and SGLang do.

- `compiler.py` (`GrammarCompilers`): compiles a request's `StructuredOutputs` against the model's
  vocabulary, never on the busy loop's thread, through a bounded LRU cache keyed by the constraint, so
  identical constraints compile once: a serving engine in processes it can pause and kill
  (`compile_farm.py`, each process running `compile_worker.py`), the offline API on a small thread pool
  (xgrammar releases the GIL while it compiles). The vocabulary comes from the model directory's tokenizer
  files, read once on a thread: the one place the engine reads a tokenizer.
- `grammar.py` (`RequestGrammar`): one request's matcher - the grammar state after its output tokens.
  Each engine request (so each of n completions) has its own.
- `bitmask.py`: each step, the scheduler fills one bitmask row per constrained request that samples
  (`fill_bitmask`), sends it with the `SchedulerOutput` (computed once, on the driver: every TP rank
  receives the same rows), and the model runner masks those rows' logits before sampling
  (`apply_bitmask`: xgrammar's CPU kernel on CPU, its GPU kernel on CUDA). A batch without constrained
  rows carries no bitmask and pays nothing.

Lifecycle (engine_svc/sched/scheduler.py): a request with a constraint waits in WAITING_FOR_FSM until
its grammar is compiled (other requests keep stepping); a compile error ends it with INVALID_ARGUMENT
naming the reason; otherwise it joins the waiting queue with its matcher, which accepts every sampled
token. Preemption keeps the output tokens (recompute), so the matcher, which has accepted exactly
those tokens, stays valid. An aborted request drops its matcher and its claim on the compile.
"""
