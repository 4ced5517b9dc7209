"""What bounds the work of compiling an output constraint, checked before the engine compiles anything.

xgrammar compiles a constraint into a grammar and precomputes, for every grammar position where a token
may start, which vocabulary entries fit. Its time is not linear in the constraint's size: measured with a
49k vocabulary (BENCHMARKS.md, "Grammar compiles"), a JSON schema of nested objects took 0.13 s at 64
levels, 3.5 s at 200 and minutes past 400 (about cubic in depth, and a gigabyte at 800); an object with
4,000 optional properties 4 s, 16,000 of them 55 s (quadratic); a regex of 8,000 three-way alternations
12 s. These checks refuse the shapes that drive those curves, before any compile, in both services (the
request contract runs them: shared_runtime/contract.py):

- JSON schema (and a structural tag, which holds schemas): the document nests at most
  `MAX_SCHEMA_NESTING` JSON objects and arrays; it holds at most `MAX_SCHEMA_OBJECTS` objects
  (subschemas) in all, at most `MAX_OBJECT_PROPERTIES` properties in one object, at most
  `MAX_ENUM_VALUES` enum / const values in all, and its `pattern`s at most `MAX_PATTERN_OPERATORS` regex
  operators together.
- Regex and EBNF grammar: at most `MAX_REGEX_OPERATORS` operators (`( | * + ? {`) and
  `MAX_GROUP_NESTING` nested groups.

They bound the known blow-ups, not every cost: what passes them still compiles in a process of its own
that is killed at its deadline or past its memory bound (engine_svc/structured/compile_farm.py).
Each check returns the reason a constraint is refused, or None.
"""

from __future__ import annotations

import functools
import json
from typing import Any

MAX_SCHEMA_NESTING = 64  # JSON objects and arrays inside one another: 32 levels of subschemas
MAX_SCHEMA_OBJECTS = 4096
MAX_OBJECT_PROPERTIES = 1024
MAX_ENUM_VALUES = 4096
MAX_PATTERN_OPERATORS = 2048
MAX_REGEX_OPERATORS = 2048
MAX_GROUP_NESTING = 64
_OPERATORS = "(|*+?{"


@functools.lru_cache(maxsize=64)  # both services check every request; many share their schema
def json_schema_problem(text: str) -> str | None:
    """Why a JSON schema (JSON text) would cost too much to compile, or None. Text that is not JSON is
    left for the compiler to report."""
    try:
        schema = json.loads(text)
    except RecursionError:
        return f"the schema nests more than {MAX_SCHEMA_NESTING} JSON objects and arrays"
    except ValueError:
        return None
    return _document_problem(schema)


def structural_tag_problem(text: str) -> str | None:
    """A structural tag holds JSON schemas: the schema bounds apply to the whole document."""
    return json_schema_problem(text)


@functools.lru_cache(maxsize=64)
def regex_problem(text: str) -> str | None:
    """Why a regex or EBNF grammar would cost too much to compile, or None."""
    operators = sum(text.count(op) for op in _OPERATORS)
    if operators > MAX_REGEX_OPERATORS:
        return f"it has {operators} operators ({' '.join(_OPERATORS)}); at most {MAX_REGEX_OPERATORS} are allowed"
    depth = deepest = 0
    for char in text:
        if char == "(":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif char == ")":
            depth -= 1
    if deepest > MAX_GROUP_NESTING:
        return f"it nests {deepest} groups; at most {MAX_GROUP_NESTING} are allowed"
    return None


def _document_problem(schema: Any) -> str | None:
    """One walk over the parsed document, iterative (a deep document cannot exhaust the stack)."""
    objects = enums = pattern_ops = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_NESTING:
            return f"the schema nests more than {MAX_SCHEMA_NESTING} JSON objects and arrays"
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node if isinstance(item, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        objects += 1
        if objects > MAX_SCHEMA_OBJECTS:
            return f"the schema holds more than {MAX_SCHEMA_OBJECTS} objects (subschemas)"
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > MAX_OBJECT_PROPERTIES:
            return (f"an object of the schema has {len(properties)} properties; at most {MAX_OBJECT_PROPERTIES} "
                    "are allowed")
        enum = node.get("enum")
        enums += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        if enums > MAX_ENUM_VALUES:
            return f"the schema holds more than {MAX_ENUM_VALUES} enum and const values"
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            pattern_ops += sum(pattern.count(op) for op in _OPERATORS)
            if pattern_ops > MAX_PATTERN_OPERATORS:
                return f"the schema's patterns have more than {MAX_PATTERN_OPERATORS} regex operators together"
        stack.extend((value, depth + 1) for value in node.values() if isinstance(value, (dict, list)))
    return None
