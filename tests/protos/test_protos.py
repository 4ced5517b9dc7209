"""The protobuf contracts: generated code is fresh, buf lint passes, and the contract's names and numbers hold.

The names and numbers below are the public and internal API contracts of docs/architecture.md
("Contracts"); they are what clients in other languages compile against, so a change here is a breaking
change.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.v1 import generation_pb2 as gpb

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"

T = FieldDescriptor
BOOL, STRING, FLOAT, DOUBLE = T.TYPE_BOOL, T.TYPE_STRING, T.TYPE_FLOAT, T.TYPE_DOUBLE
INT32, UINT32, UINT64, ENUM, MESSAGE = T.TYPE_INT32, T.TYPE_UINT32, T.TYPE_UINT64, T.TYPE_ENUM, T.TYPE_MESSAGE


def _load_gen_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", GEN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- generation ----------------------------------------------------------------------------------------


def test_generated_code_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--check"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, f"stale generated code; run `make protos`\n{result.stderr}"


def test_check_mode_detects_stale_missing_and_extra_files(tmp_path: Path) -> None:
    gen = _load_gen_script()
    root = tmp_path / "protos"
    shutil.copytree(REPO_ROOT / "protos" / "tandem", root / "tandem")
    assert gen.stale_files(root) == []

    pb2 = root / "tandem" / "v1" / "generation_pb2.py"
    pb2.write_text(pb2.read_text() + "\n# edited by hand\n")
    (root / "tandem" / "v1" / "generation_pb2_grpc.py").unlink()
    (root / "tandem" / "v1" / "old_pb2.py").write_text("")
    assert gen.stale_files(root) == [
        "missing: tandem/v1/generation_pb2_grpc.py",
        "extra:   tandem/v1/old_pb2.py",
        "stale:   tandem/v1/generation_pb2.py",
    ]


def test_generated_imports_use_the_tandem_package() -> None:
    grpc_module = REPO_ROOT / "protos" / "tandem" / "engine" / "v1" / "engine_core_pb2_grpc.py"
    assert "from tandem.engine.v1 import engine_core_pb2" in grpc_module.read_text()


# ---- buf lint ------------------------------------------------------------------------------------------


def test_buf_lint_passes() -> None:
    if not (REPO_ROOT / "node_modules" / ".bin" / "buf").exists() or shutil.which("npx") is None:
        pytest.fail("buf is not installed (node_modules/.bin/buf missing); run `make install` (npm ci)")
    result = subprocess.run(
        ["npx", "--no", "buf", "lint", "protos"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"buf lint failed:\n{result.stdout}{result.stderr}"


# ---- the contract --------------------------------------------------------------------------------------

# (message, {field: (number, type, optional/presence-tracked, repeated)}), as docs/architecture.md's
# "Contracts" and the protos' own comments define them.
PUBLIC_FIELDS: dict[Descriptor, dict[str, tuple[int, int, bool, bool]]] = {
    gpb.GenerateRequest.DESCRIPTOR: {
        "request_id": (1, STRING, False, False),
        "text": (2, STRING, True, False),
        "token_ids": (3, MESSAGE, True, False),
        "chat": (4, MESSAGE, True, False),
        "sampling_params": (5, MESSAGE, True, False),
        "priority": (6, INT32, False, False),
    },
    gpb.TokenIds.DESCRIPTOR: {"ids": (1, UINT32, False, True)},
    gpb.Chat.DESCRIPTOR: {
        "messages": (1, MESSAGE, False, True),
        "add_generation_prompt": (2, BOOL, False, False),
    },
    gpb.ChatMessage.DESCRIPTOR: {"role": (1, STRING, False, False), "content": (2, STRING, False, False)},
    gpb.SamplingParams.DESCRIPTOR: {
        "temperature": (1, FLOAT, True, False),
        "top_p": (2, FLOAT, True, False),
        "top_k": (3, INT32, True, False),
        "min_p": (4, FLOAT, True, False),
        "seed": (5, UINT64, True, False),
        "max_tokens": (6, UINT32, True, False),
        "min_tokens": (7, UINT32, False, False),
        "stop": (8, STRING, False, True),
        "stop_token_ids": (9, UINT32, False, True),
        "include_stop_str_in_output": (10, BOOL, False, False),
        "ignore_eos": (11, BOOL, False, False),
        "presence_penalty": (12, FLOAT, False, False),
        "frequency_penalty": (13, FLOAT, False, False),
        "repetition_penalty": (14, FLOAT, True, False),
        "logprobs": (15, UINT32, True, False),
        "prompt_logprobs": (16, UINT32, True, False),
        "n": (17, UINT32, False, False),
        "skip_special_tokens": (18, BOOL, True, False),
        "logit_bias": (19, MESSAGE, False, True),  # map<uint32, float>
    },
    gpb.GenerateResponse.DESCRIPTOR: {
        "request_id": (1, STRING, False, False),
        "index": (2, UINT32, False, False),
        "text": (3, STRING, False, False),
        "token_ids": (4, UINT32, False, True),
        "logprobs": (5, MESSAGE, False, True),
        "finish_reason": (6, ENUM, False, False),
        "stop_string": (7, STRING, True, False),
        "stop_token_id": (8, UINT32, True, False),
        "usage": (9, MESSAGE, True, False),
    },
    gpb.Usage.DESCRIPTOR: {
        "prompt_tokens": (1, UINT32, False, False),
        "completion_tokens": (2, UINT32, False, False),
        "cached_prompt_tokens": (3, UINT32, False, False),
    },
}

INTERNAL_FIELDS: dict[Descriptor, dict[str, tuple[int, int, bool, bool]]] = {
    epb.EngineCoreInput.DESCRIPTOR: {"add": (1, MESSAGE, True, False), "abort": (2, MESSAGE, True, False)},
    epb.EngineLoad.DESCRIPTOR: {
        "num_running": (1, UINT32, False, False),
        "num_waiting": (2, UINT32, False, False),
        "kv_cache_usage": (3, FLOAT, False, False),
        "num_free_blocks": (4, UINT32, False, False),
        "num_total_blocks": (5, UINT32, False, False),
        "prefix_cache_queries": (6, UINT64, False, False),
        "prefix_cache_hits": (7, UINT64, False, False),
    },
}


def _field_shape(field: FieldDescriptor) -> tuple[int, int, bool, bool]:
    return (field.number, field.type, field.has_presence, field.is_repeated)


@pytest.mark.parametrize("descriptor", list(PUBLIC_FIELDS) + list(INTERNAL_FIELDS), ids=lambda d: d.full_name)
def test_contract_fields_have_their_numbers_and_types(descriptor: Descriptor) -> None:
    expected = {**PUBLIC_FIELDS, **INTERNAL_FIELDS}[descriptor]
    actual = {name: _field_shape(descriptor.fields_by_name[name]) for name in expected}
    assert actual == expected


def test_engine_load_has_exactly_the_contract_fields() -> None:
    fields = epb.EngineLoad.DESCRIPTOR.fields
    assert [(f.name, f.number) for f in fields] == [
        (name, shape[0]) for name, shape in INTERNAL_FIELDS[epb.EngineLoad.DESCRIPTOR].items()
    ]


def test_contract_oneofs() -> None:
    def oneof_members(descriptor: Descriptor, oneof: str) -> list[str]:
        return [f.name for f in descriptor.oneofs_by_name[oneof].fields]

    assert oneof_members(gpb.GenerateRequest.DESCRIPTOR, "prompt") == ["text", "token_ids", "chat"]
    assert oneof_members(gpb.GenerateResponse.DESCRIPTOR, "stop_reason") == ["stop_string", "stop_token_id"]
    assert oneof_members(epb.EngineCoreInput.DESCRIPTOR, "kind") == ["add", "abort"]


def test_contract_message_types() -> None:
    request = gpb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert request["token_ids"].message_type is gpb.TokenIds.DESCRIPTOR
    assert request["chat"].message_type is gpb.Chat.DESCRIPTOR
    assert request["sampling_params"].message_type is gpb.SamplingParams.DESCRIPTOR
    response = gpb.GenerateResponse.DESCRIPTOR.fields_by_name
    assert response["finish_reason"].enum_type is gpb.FinishReason.DESCRIPTOR
    assert response["usage"].message_type is gpb.Usage.DESCRIPTOR
    assert response["logprobs"].message_type is gpb.TokenLogprobs.DESCRIPTOR
    kind = epb.EngineCoreInput.DESCRIPTOR.fields_by_name
    assert kind["add"].message_type is epb.EngineCoreRequest.DESCRIPTOR
    assert kind["abort"].message_type is epb.AbortRequests.DESCRIPTOR


def _methods(file_descriptor, service: str) -> dict[str, tuple[str, str, bool, bool]]:  # type: ignore[no-untyped-def]
    methods = file_descriptor.services_by_name[service].methods
    return {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
        for m in methods
    }


def test_public_service_methods() -> None:
    assert _methods(gpb.DESCRIPTOR, "GenerationService") == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, True),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False, False),
        "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False, False),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False, False),
    }
    assert gpb.DESCRIPTOR.package == "tandem.v1"


def test_internal_service_methods() -> None:
    assert _methods(epb.DESCRIPTOR, "EngineCoreService") == {
        "Connect": ("EngineCoreInput", "EngineCoreOutputs", True, True),
        "GetEngineInfo": ("GetEngineInfoRequest", "EngineInfo", False, False),
        "GetLoad": ("GetLoadRequest", "EngineLoad", False, False),
        "SubscribeKvEvents": ("SubscribeKvEventsRequest", "KvEventBatch", False, True),
        "GetTokenizer": ("GetTokenizerRequest", "TokenizerChunk", False, True),
        "PullKvBlocks": ("PullKvBlocksRequest", "KvBlocksChunk", False, True),
        "LoadLoraAdapter": ("LoadLoraAdapterRequest", "LoadLoraAdapterResponse", False, False),
        "UnloadLoraAdapter": ("UnloadLoraAdapterRequest", "UnloadLoraAdapterResponse", False, False),
        "WatchLoraAdapters": ("WatchLoraAdaptersRequest", "LoraAdapterSet", False, True),
    }
    assert epb.DESCRIPTOR.package == "tandem.engine.v1"


def _enum_values(enum: EnumDescriptor) -> dict[str, int]:
    return {value.name: value.number for value in enum.values}


def test_finish_reason_enums() -> None:
    public = {"FINISH_REASON_UNSPECIFIED": 0, "FINISH_REASON_STOP": 1, "FINISH_REASON_LENGTH": 2}
    public["FINISH_REASON_ABORT"] = 3
    assert _enum_values(gpb.FinishReason.DESCRIPTOR) == public
    assert _enum_values(epb.FinishReason.DESCRIPTOR) == {**public, "FINISH_REASON_ERROR": 4}


def test_request_event_type_enum() -> None:
    names = ["UNSPECIFIED", "QUEUED", "SCHEDULED", "PREEMPTED", "FIRST_TOKEN", "FINISHED"]
    expected = {f"REQUEST_EVENT_TYPE_{name}": number for number, name in enumerate(names)}
    assert _enum_values(epb.RequestEventType.DESCRIPTOR) == expected


@pytest.mark.parametrize("file_descriptor", [gpb.DESCRIPTOR, epb.DESCRIPTOR], ids=lambda f: f.name)
def test_every_enum_starts_with_unspecified_zero(file_descriptor) -> None:  # type: ignore[no-untyped-def]
    for enum in file_descriptor.enum_types_by_name.values():
        first = enum.values[0]
        assert (first.name, first.number) == (f"{_screaming_snake(enum.name)}_UNSPECIFIED", 0)


def _screaming_snake(name: str) -> str:
    return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).upper()
