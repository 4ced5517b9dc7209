"""Every bound on what one request may ask for, written once for both services.

The frontend checks them for its clients (field-path errors, before any expensive work); the engine
checks them again for whatever reaches it over `Connect` (defence in depth: it does not trust the
frontend). The sampling rules that use them are `SamplingParams.violations()` in
shared_runtime/contract.py; the size checks below run before tokenization.

The bounds, and why:
- Request id: the client's at most 256 bytes of printable ASCII (0x20-0x7E): it is echoed in every
  response and is part of every engine request id. The engine takes ids of up to 512 bytes (the
  frontend's ids are the client's plus a short suffix).
- n: at most 64 completions per request (more is almost surely a client bug; each is an engine request).
- Logprobs: top-N of at most 20 per token (OpenAI's bound; each costs a top-k over the vocabulary).
- Stop strings: at most 16 of at most 1024 characters (like TGI's --max-stop-sequences, but roomier):
  the stop checker is linear in their total length, and the text held back while one might still match
  is shorter than the longest.
- Token-id lists (stop_token_ids, eos_token_ids): at most 1024 ids; the engine scans them per token.
- logit_bias: at most 1024 entries (the bound of the token-id lists; each entry is one scattered add to
  its row's logits per sampled token), biases in [-100, 100] as OpenAI documents them (the frontend
  clamps to this range, as vLLM does; the engine refuses a raw value outside it).
- Structured outputs: a constraint's text (JSON schema, regex, EBNF grammar, structural tag, or all
  choices together) is at most 256 KiB, and a choice holds at most 256 strings. Checked before any
  work: compiling a grammar is linear (or worse) in its size, on the engine's compile threads.
- Penalties: presence and frequency in [-2, 2] (OpenAI's range). Temperature in [0, 2] (OpenAI's and
  vLLM's range); below 1e-5 it is greedy, where n must be 1 (vLLM: n identical completions are a bug).
- allowed_token_ids: at most 262144 ids (more than any vocabulary here; each is one scattered write per
  sampled token). bad_words: at most 128 words of at most 1024 characters, and at most 128 token
  sequences after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS); each sequence at most 1024 ids.
- Integers on the engine link are 32-bit (top_k, min_tokens, token ids, priority) or, for seeds, 64-bit.
- Trace headers: at most 8 entries of at most 1024 bytes each.
- Text prompt: at most `max_model_len * PROMPT_BYTES_PER_TOKEN` UTF-8 bytes. The factor (32) is far
  above what real tokenizers produce (about 4 bytes per token for English, under 8 for code or CJK), so
  a prompt this rejects could never fit the context window anyway; it only spares the tokenizer (and
  everyone waiting for it) from megabytes that are bound to be rejected.
- Chat: at most `max_model_len` messages (every message renders to at least one token) and the same
  byte budget over all roles and contents, checked before the template runs.
- Token-id prompt: the count is checked against max_model_len before the ids are copied or scanned.
- An HTTP JSON body, counted on its raw bytes before anything is parsed (parsing holds the GIL, so a
  parse on a thread still stalls every stream: 100k Responses input items cost 345 ms): at most
  `4 * max_model_len + vocab_size + 65536` commas (about one per array element or object member; a
  prompt has fewer ids than max_model_len, allowed_token_ids fewer than the vocabulary, a legit text
  fewer punctuation marks than tokens) and `max_model_len / 2 + 4096` opening braces (objects: a chat
  message renders to several tokens; the floor leaves room for tools and schemas). Commas and braces
  inside strings count too: counting them costs ~1 ms per MB, telling them apart would cost a parse.

Each size check returns a `FieldViolation` (field = the dot path in `tandem.v1.GenerateRequest`) or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared_runtime.violations import FieldViolation

MAX_REQUEST_ID_BYTES = 256
MAX_ENGINE_REQUEST_ID_BYTES = 512
MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_BOUND = 100.0
PENALTY_BOUND = 2.0
MAX_TEMPERATURE = 2.0
GREEDY_TEMPERATURE = 1e-5
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 128
MAX_STRUCTURED_OUTPUT_BYTES = 256 * 1024
MAX_CHOICES = 256
MAX_TOOLS = 128  # tool definitions per chat request (their schemas count toward the body limit)
INT32_MAX = (1 << 31) - 1
INT32_MIN = -(1 << 31)
UINT64_LIMIT = 1 << 64
MAX_TRACE_HEADERS = 8
MAX_TRACE_HEADER_BYTES = 1024
PROMPT_BYTES_PER_TOKEN = 32
JSON_COMMAS_PER_TOKEN = 4
JSON_COMMAS_FLOOR = 65_536
JSON_OBJECTS_FLOOR = 4096


def max_prompt_bytes(max_model_len: int) -> int:
    """The largest text prompt (UTF-8 bytes) worth tokenizing for this context window."""
    return max_model_len * PROMPT_BYTES_PER_TOKEN


def max_json_commas(max_model_len: int, vocab_size: int) -> int:
    """Commas an HTTP JSON body may hold (array elements and object members, strings' commas included)."""
    return JSON_COMMAS_PER_TOKEN * max_model_len + vocab_size + JSON_COMMAS_FLOOR


def max_json_objects(max_model_len: int) -> int:
    """Opening braces an HTTP JSON body may hold (objects, strings' braces included)."""
    return max_model_len // 2 + JSON_OBJECTS_FLOOR


def request_id_violation(request_id: str) -> FieldViolation | None:
    """`request_id` must be at most 256 bytes of printable ASCII (empty means: assign one)."""
    if len(request_id) > MAX_REQUEST_ID_BYTES or not (request_id.isascii() and request_id.isprintable()):
        return FieldViolation(
            "request_id", f"must be at most {MAX_REQUEST_ID_BYTES} printable ASCII characters "
                          f"(got {len(request_id)} characters)")
    return None


def text_size_violation(text: str, max_model_len: int) -> FieldViolation | None:
    """A text prompt larger than the byte budget of the context window."""
    limit = max_prompt_bytes(max_model_len)
    if _utf8_len(text, limit) > limit:
        return FieldViolation("text", f"the prompt is larger than {limit} bytes, which cannot fit in "
                                      f"max_model_len ({max_model_len}) tokens")
    return None


def chat_size_violation(messages: Sequence[Any], max_model_len: int) -> FieldViolation | None:
    """Too many messages, or more text than the context window could hold, before rendering."""
    if len(messages) > max_model_len:
        return FieldViolation("chat.messages", f"the chat has {len(messages)} messages; at most "
                                               f"max_model_len ({max_model_len}) fit in the context")
    limit = max_prompt_bytes(max_model_len)
    total = 0
    for message in messages:
        if isinstance(message, dict):
            for value in (message.get("role"), message.get("content")):
                if isinstance(value, str):
                    total += _utf8_len(value, limit - total)
        if total > limit:
            return FieldViolation("chat.messages", f"the chat is larger than {limit} bytes, which cannot "
                                                   f"fit in max_model_len ({max_model_len}) tokens")
    return None


def _utf8_len(text: str, budget: int) -> int:
    """UTF-8 length of `text`, or just over `budget` when its character count already exceeds it."""
    if len(text) > budget:  # characters never outnumber bytes
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def token_count_violation(count: int, max_model_len: int) -> FieldViolation | None:
    """A token-id prompt that cannot fit (checked before the ids are copied or scanned)."""
    if count >= max_model_len:
        return FieldViolation("token_ids.ids", f"the prompt has {count} tokens; it must be shorter than "
                                               f"max_model_len ({max_model_len})")
    return None
