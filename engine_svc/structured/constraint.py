"""One constraint as xgrammar compiles it: its cache key, the compile call for its kind, and xgrammar's
error as a one-line reason. Shared by the engine's compile threads (compiler.py) and its compile
processes (compile_worker.py)."""

from __future__ import annotations

import json
import re
from typing import Any

Key = tuple[str, str]  # (kind, text): what makes two constraints compile to the same grammar
# JSON may be written compact or pretty-printed (any whitespace between tokens, as vLLM allows), but at
# most this many whitespace characters in a row: enough for indented output 7 levels deep, and a small
# model cannot spend its max_tokens on an endless run of spaces and newlines inside the object.
MAX_JSON_WHITESPACE = 16


class UnknownKind(ValueError):
    """A key whose kind is no constraint kind."""


def compile_key(compiler: Any, key: Key) -> Any:
    """`key`'s constraint compiled by an xgrammar `GrammarCompiler` (blocking; raises what xgrammar raises)."""
    kind, text = key
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    if kind == "grammar":
        return compiler.compile_grammar(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(text)
    raise UnknownKind(f"unknown constraint kind {kind!r}")


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root is exactly one of `choices` (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
MAX_REASON_CHARS = 500


def reason(exc: BaseException) -> str:
    """xgrammar's message without its timestamp and C++ source location, on one bounded line."""
    text = " ".join(_XGRAMMAR_PREFIX.sub("", str(exc).strip()).split())
    text = text or type(exc).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."
