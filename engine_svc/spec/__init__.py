"""Speculative decoding (vLLM V1's design): drafts proposed on the host, verified by the target model.

- `config.py`: `--speculative-config` (vLLM's JSON names) parsed and checked; which requests may speculate.
- `ngram.py`: prompt lookup, the draft proposer that needs no model (the request's own tokens).
- `rejection.py`: the worker's verification of one step's drafts (greedy: longest matching prefix;
  random: the rejection rule that preserves the target distribution).
- `stats.py`: the acceptance counters (vLLM's spec_decode_* metrics).

The scheduler (engine_svc/sched/scheduler.py) schedules 1 + k tokens for a decoding request with k
drafts, and gives back the rejected drafts' positions (`num_computed_tokens`) when their verdict comes.
"""
