"""docs/architecture.md's RPC and field lists (section "Contracts") equal the proto descriptors.

Every line of the form ``- `Message`: `field` N, `field` N, ...`` must list exactly that message's fields
with their numbers, and ``- RPCs of `package.Service`: `Method` ..., ...`` exactly the service's methods.
The messages the contract section must describe are listed below, so a message left out, a field added
to the proto and not to the doc, or a number mistyped, each fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FileDescriptor
from tandem.engine.v1 import engine_core_pb2
from tandem.v1 import generation_pb2

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
FILES: tuple[FileDescriptor, ...] = (generation_pb2.DESCRIPTOR, engine_core_pb2.DESCRIPTOR)
DOCUMENTED = {
    "GenerateRequest", "SamplingParams", "GenerateResponse", "Usage",
    "EngineCoreInput", "EngineCoreRequest", "EngineSamplingParams", "EngineCoreOutputs", "EngineCoreOutput",
    "EngineInfo", "EngineLoad", "KvTransferParams", "KvCacheLayout", "PullKvBlocksRequest", "KvBlocksChunk",
    "LoraAdapterInfo", "LoraAdapterSet", "LoadLoraAdapterResponse", "UnloadLoraAdapterResponse", "KvBlocksStored",
}
SERVICES = {"tandem.v1.GenerationService", "tandem.engine.v1.EngineCoreService"}

_ITEM = re.compile(r"^- (?:(RPCs of )`([\w.]+)`|`(\w+)`(?: \([^)]*\))?): (`.*?)(?=^- |^\S|\Z)", re.M | re.S)
_FIELD = re.compile(r"`(\w+)` (\d+)")
_METHOD = re.compile(r"`(\w+)`")


def contracts_section(text: str) -> str:
    start = text.index("## Contracts")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def documented(section: str) -> tuple[dict[str, set[tuple[str, int]]], dict[str, set[str]]]:
    """(message -> {(field, number)}, service -> {method}) as the doc lists them; text in parentheses
    (explanations) is ignored."""
    messages: dict[str, set[tuple[str, int]]] = {}
    services: dict[str, set[str]] = {}
    for match in _ITEM.finditer(section):
        is_rpc, name, rest = match.group(1), match.group(2) or match.group(3), _without_parentheses(match.group(4))
        if is_rpc:
            services[name] = set(_METHOD.findall(rest))
        else:
            messages[name] = {(f, int(n)) for f, n in _FIELD.findall(rest)}
    return messages, services


def _without_parentheses(text: str) -> str:
    depth, kept = 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(0, depth - 1)
        elif depth == 0:
            kept.append(char)
    return "".join(kept)


def _message(name: str) -> Descriptor:
    for file in FILES:
        if name in file.message_types_by_name:
            return file.message_types_by_name[name]
    raise KeyError(name)


def _methods(full_name: str) -> set[str]:
    for file in FILES:
        for service in file.services_by_name.values():
            if service.full_name == full_name:
                return {m.name for m in service.methods}
    raise KeyError(full_name)


MESSAGES, RPCS = documented(contracts_section(DOC.read_text(encoding="utf-8")))


def test_the_doc_describes_every_contract_message_and_service() -> None:
    assert set(MESSAGES) == DOCUMENTED
    assert set(RPCS) == SERVICES


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_a_message_s_fields_and_numbers_are_the_proto_s(name: str) -> None:
    proto = {(f.name, f.number) for f in _message(name).fields}
    assert MESSAGES.get(name) == proto, (
        f"docs/architecture.md lists {name} as {sorted(MESSAGES.get(name, set()), key=lambda x: x[1])}; "
        f"the proto has {sorted(proto, key=lambda x: x[1])}")


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_service_s_rpcs_are_the_proto_s(service: str) -> None:
    assert RPCS.get(service) == _methods(service)


def test_the_reader_sees_a_missing_field() -> None:
    section = ("## Contracts\n- `Usage`: `prompt_tokens` 1, `completion_tokens` 2 (and more)\n"
               "- RPCs of `tandem.v1.GenerationService`: `Generate` (a `Stream`), `Tokenize`\n\n## Next\n")
    messages, services = documented(contracts_section(section))
    assert messages == {"Usage": {("prompt_tokens", 1), ("completion_tokens", 2)}}
    assert services == {"tandem.v1.GenerationService": {"Generate", "Tokenize"}}
    assert messages["Usage"] != {(f.name, f.number) for f in _message("Usage").fields}
