"""The compile-cost bounds of structured outputs (shared_runtime/grammar_bounds.py), checked by the request
contract in both services before anything compiles: each bound at its edge (accepted) and one past it
(refused, naming the field), and the issue's reproductions (800 nested objects, 1,000 nested arrays: a
compile of minutes and gigabytes) refused at once."""

from __future__ import annotations

import json
import time

import pytest

from shared_runtime import grammar_bounds as gb
from shared_runtime.contract import EngineSamplingParams, SamplingParams, StructuredOutputs
from shared_runtime.violations import ValidationError


def arrays(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


def objects(depth: int) -> str:
    return '{"type":"object","required":["a"],"properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


def props(count: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}})


def test_each_bound_at_its_edge_and_one_past_it() -> None:
    # nesting: an array schema nests one JSON level per level, an object schema two (object, properties)
    assert gb.json_schema_problem(arrays(gb.MAX_SCHEMA_NESTING - 1)) is None
    assert "nests more than 64" in (gb.json_schema_problem(arrays(gb.MAX_SCHEMA_NESTING)) or "")
    assert gb.json_schema_problem(objects(31)) is None and gb.json_schema_problem(objects(32)) is not None
    assert gb.json_schema_problem(props(gb.MAX_OBJECT_PROPERTIES)) is None
    assert "1025 properties" in (gb.json_schema_problem(props(gb.MAX_OBJECT_PROPERTIES + 1)) or "")
    many = json.dumps({"anyOf": [{"type": "integer"}] * (gb.MAX_SCHEMA_OBJECTS - 1)})
    assert gb.json_schema_problem(many) is None
    too_many = json.dumps({"anyOf": [{"type": "integer"}] * gb.MAX_SCHEMA_OBJECTS})
    assert "more than 4096 objects" in (gb.json_schema_problem(too_many) or "")
    enum = json.dumps({"enum": list(range(gb.MAX_ENUM_VALUES))})
    assert gb.json_schema_problem(enum) is None
    assert gb.json_schema_problem(json.dumps({"enum": list(range(gb.MAX_ENUM_VALUES + 1))})) is not None
    pattern = json.dumps({"type": "string", "pattern": "(a|b)" * 1024})  # 2,048 operators: ( and |
    assert gb.json_schema_problem(pattern) is None
    assert gb.json_schema_problem(json.dumps({"type": "string", "pattern": "(a|b)" * 1025})) is not None
    assert gb.regex_problem("(a|b)" * 1024) is None and gb.regex_problem("(a|b)" * 1025) is not None
    assert gb.regex_problem("(" * 64 + "a" + ")" * 64) is None
    assert "nests 65 groups" in (gb.regex_problem("(" * 65 + "a" + ")" * 65) or "")
    assert gb.json_schema_problem("not json") is None  # left for the compiler to report


@pytest.mark.parametrize("kind, text", [("json", objects(800)), ("json", arrays(1000)), ("json", arrays(10_000)),
                                        ("structural_tag", json.dumps({"format": json.loads(arrays(100))})),
                                        ("regex", "(a|b|c)" * 8000), ("grammar", 'root ::= ' + '"a"* ' * 8000)])
def test_the_issues_constraints_are_refused_before_compiling_by_both_services(kind: str, text: str) -> None:
    """Before: 800 nested objects kept a compile thread busy for minutes (and ~1 GB); 8,000 three-way
    alternations took 12 s; nothing refused them."""
    start = time.perf_counter()
    with pytest.raises(ValidationError) as caught:
        SamplingParams(structured_outputs=StructuredOutputs(**{kind: text}))  # the frontend's (and SMG's) rules
    took = time.perf_counter() - start
    assert [v.field for v in caught.value.violations] == [f"structured_outputs.{kind}"]
    assert "would cost too much to compile" in str(caught.value)
    assert took < 0.2, f"the check took {took * 1000:.0f} ms"
    engine = EngineSamplingParams(structured_outputs=StructuredOutputs(**{kind: text}))  # the engine's own check
    assert [v.field for v in engine.violations(512)] == [f"structured_outputs.{kind}"]
