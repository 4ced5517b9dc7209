"""Prefill/decode disaggregation, as the frontend drives it (`--routing pd`).

A request goes first to an engine of the prefill pool (EngineInfo.kv_role `kv_producer` or `kv_both`) as
`max_tokens=1` with `kv_transfer_params.do_remote_decode`: that engine computes the prompt and the first
token, keeps the prompt's K/V blocks under a lease and names them in its last output. The frontend
streams that first token to the client as an ordinary one (the prefill's LENGTH finish is not the
request's), then continues each completion on an engine of the decode pool (`kv_consumer` or `kv_both`)
as a continuation (the prompt, the first token as output) with `do_remote_prefill` naming the blocks: the
decode engine pulls what its prefix cache lacks and generates the rest. The client's stream is the one a
single engine would give: same tokens, same logprobs.

A request goes the plain way (one engine) when P/D cannot help or cannot apply: `max_tokens` is 1, the
prompt leaves no room for a second token, or either pool has no ready engine. A completion that ends on
its first token (EOS, a stop string) never reaches a decode engine; its kept blocks are released by the
abort the dispatcher sends for it, or expire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from tandem.engine.v1 import engine_core_pb2 as epb

from shared_runtime.contract import EngineCoreRequest, KvTransferParams
from shared_runtime.from_pb import kv_transfer_params_from_pb
from shared_runtime.kv_transfer_params import handoff

PREFILL_ROLES = frozenset({"kv_producer", "kv_both"})
DECODE_ROLES = frozenset({"kv_consumer", "kv_both"})
PREFILL, DECODE = "prefill", "decode"


def in_pool(kv_role: str, pool: str) -> bool:
    """Whether an engine announcing `kv_role` serves `pool` (PREFILL or DECODE)."""
    return kv_role in (PREFILL_ROLES if pool == PREFILL else DECODE_ROLES)


def wants_disaggregation(requests: Sequence[EngineCoreRequest], max_model_len: int) -> bool:
    """Whether these engine requests (the n completions of one client request) gain from P/D: more than
    one token to generate, with room for it."""
    for request in requests:
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and max_tokens <= 1:
            return False
        if len(request.prompt_token_ids) + 1 >= max_model_len:
            return False
    return True


def prefill_request(request: EngineCoreRequest) -> EngineCoreRequest:
    """The prefill engine's part: the first token, with the prompt's blocks kept for a decode engine.
    `min_tokens` is capped at 1: the first token is sampled as the whole request's would be (stops masked
    if min_tokens > 0), and the decode engine applies the full value to the rest."""
    sampling = request.sampling_params
    params = msgspec.structs.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))
    return msgspec.structs.replace(request, sampling_params=params,
                                   kv_transfer_params=KvTransferParams(do_remote_decode=True))


def kept_blocks(output: epb.EngineCoreOutput) -> KvTransferParams | None:
    """The producer's kept blocks if this is a prefill's last output that kept them, else None."""
    if output.finish_reason != epb.FINISH_REASON_LENGTH or not output.HasField("kv_transfer_params"):
        return None
    return kv_transfer_params_from_pb(output.kv_transfer_params)


def kept_kv_params(output: epb.EngineCoreOutput) -> dict[str, Any] | None:
    """For a client that drives P/D itself (an OpenAI body's kv_transfer_params): the object to send the
    decode server, as vLLM's responses report it, from a last output whose engine kept the prompt's
    blocks; None when it kept none."""
    if not output.HasField("kv_transfer_params"):
        return None
    return handoff(kv_transfer_params_from_pb(output.kv_transfer_params))


def decode_request(original: EngineCoreRequest, request_id: str, generated: list[int], kept: KvTransferParams,
                   drop_prompt_logprobs: bool) -> EngineCoreRequest:
    """The decode engine's part: a continuation after `generated` that pulls the prompt's K/V from `kept`."""
    params = original.sampling_params
    if drop_prompt_logprobs and params.prompt_logprobs is not None:  # the client has them from the prefill
        params = msgspec.structs.replace(params, prompt_logprobs=None)
    pull = msgspec.structs.replace(kept, do_remote_prefill=True, do_remote_decode=False)
    return msgspec.structs.replace(original, request_id=request_id, sampling_params=params,
                                   output_token_ids=list(generated), kv_transfer_params=pull)
