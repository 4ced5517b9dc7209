"""The public API's gatekeeping over real sockets: API keys (UNAUTHENTICATED, constant-time checks, key
files re-read on change, no secret in any log), malformed request bytes (INVALID_ARGUMENT without Python
exception text), and the health exemption that Kubernetes probes rely on."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from frontend_svc.client import TandemClient, collect
from shared_runtime.security import auth
from shared_runtime.security.auth import KeySet, bearer_token
from tests.security.secure_stack import Stack
from tests.support import LoopThread, wait_until

KEY_A = "sk-alpha-7d1f0c"
KEY_B = "sk-bravo-22e9aa"
KEY_FILE_KEY = "sk-from-file-4410"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# rotated by the platform team\n{KEY_FILE_KEY}\n\n")
    return path


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path, key_file: Path) -> Iterator[Stack]:
    stack = Stack(loop, tokenizer, tiny_model_dir, api_keys=(KEY_A, KEY_B), api_key_file=str(key_file))
    stack.wait_serving()  # health needs no key
    yield stack
    stack.close()


def code_of(call: Any) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def generate_code(address: str, **security: Any) -> grpc.StatusCode:
    with TandemClient(address, **security) as client:
        return code_of(lambda: list(client.generate(token_ids=[5, 6], max_tokens=2, timeout=10)))


def test_calls_without_a_valid_key_are_unauthenticated(stack: Stack) -> None:
    assert generate_code(stack.address) == grpc.StatusCode.UNAUTHENTICATED
    assert generate_code(stack.address, api_key="sk-wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert generate_code(stack.address, api_key=KEY_A[:-1]) == grpc.StatusCode.UNAUTHENTICATED
    for key in (KEY_A, KEY_B, KEY_FILE_KEY):
        assert generate_code(stack.address, api_key=key) == grpc.StatusCode.OK
    with TandemClient(stack.address) as client:  # unary calls too
        assert code_of(lambda: client.tokenize("hi", timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: client.model_info(timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(stack.address) as channel:  # the scheme is checked, not just the key
        call = channel.unary_unary("/tandem.v1.GenerationService/GetModelInfo")
        assert code_of(lambda: call(b"", metadata=(("authorization", f"Basic {KEY_A}"),), timeout=5)) == \
            grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_key_and_reflection_does(stack: Stack) -> None:
    with grpc.insecure_channel(stack.address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"),
                                                           timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        assert code_of(lambda: list(stub.ServerReflectionInfo(iter([request]), timeout=5))) == \
            grpc.StatusCode.UNAUTHENTICATED
        answers = list(stub.ServerReflectionInfo(iter([request]), timeout=5,
                                                 metadata=(("authorization", f"Bearer {KEY_B}"),)))
        names = {s.name for s in answers[0].list_services_response.service}
        assert "tandem.v1.GenerationService" in names


def test_the_key_file_is_reread_when_it_changes(stack: Stack, key_file: Path) -> None:
    original = key_file.read_text()
    try:
        key_file.write_text("sk-rotated-9000\n")
        wait_until(lambda: generate_code(stack.address, api_key="sk-rotated-9000") == grpc.StatusCode.OK,
                   timeout=10, what="the new key accepted")
        assert generate_code(stack.address, api_key=KEY_FILE_KEY) == grpc.StatusCode.UNAUTHENTICATED
        assert generate_code(stack.address, api_key=KEY_A) == grpc.StatusCode.OK  # flag keys stay
    finally:
        key_file.write_text(original)
        time.sleep(1.1)
        stack.frontend.api_keys.reload()


def test_no_secret_reaches_the_log(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path, key_file: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    stack = Stack(loop, tokenizer, tiny_model_dir, api_keys=(KEY_A,), api_key_file=str(key_file))
    try:
        stack.wait_serving()
        generate_code(stack.address, api_key="sk-attempted-guess")
        generate_code(stack.address, api_key=KEY_A)
        stack.frontend.reload_credentials()
        assert "API key" in caplog.text  # the start-up line names how many keys, not which
    finally:
        stack.close()
    for secret in (KEY_A, KEY_FILE_KEY, "sk-attempted-guess"):
        assert secret not in caplog.text
    assert KEY_A not in repr(stack.frontend.config)


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No early exit: the match position does not change how many comparisons run."""
    compared: list[int] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(len(a))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = KeySet([f"key-{i}" + "x" * i for i in range(5)])
    for presented in ("key-0", "key-4xxxx", "nope", "a-much-longer-wrong-key" * 10):
        compared.clear()
        keys.accepts(presented)
        assert len(compared) == 5 and set(compared) == {32}  # digests: equal lengths whatever the key
    assert keys.check_authorization("Bearer key-2xx") and keys.check_authorization("bearer   key-0")
    assert not keys.check_authorization("key-0") and not keys.check_authorization(None)
    assert bearer_token("Bearer ") is None


def test_key_sources(tmp_path: Path) -> None:
    assert KeySet.from_sources((), None, env={}) is None  # no key anywhere: authentication off
    keys = KeySet.from_sources(("a",), None, env={"TANDEM_API_KEY": "from-env"})
    assert keys is not None and keys.accepts("from-env") and keys.accepts("a")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        KeySet.from_sources((), str(empty), env={})


@pytest.mark.parametrize("flag", ["--api-key-file", "--engine-token-file"])
def test_the_frontend_refuses_a_key_file_without_a_key_in_one_line(
        flag: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from frontend_svc import cli

    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    assert cli.main(["--model", str(tiny_model_dir), "--port", "0", "--metrics-port", "0", flag, str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem-frontend: ") and "holds no" in err and "Traceback" not in err


# ---- malformed requests -------------------------------------------------------------------------------

CORRUPT = b"\xff\xff\xff\xff"  # not protobuf wire format
BAD_UTF8 = b"\x0a\x03\xff\xfe\xfd"  # field 1 (a string in GenerateRequest and TokenizeRequest): bad UTF-8
MALFORMED = [("Generate", CORRUPT), ("Generate", BAD_UTF8), ("Tokenize", CORRUPT), ("Tokenize", BAD_UTF8),
             ("Detokenize", CORRUPT), ("GetModelInfo", CORRUPT)]


@pytest.fixture(scope="module")
def open_stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[Stack]:
    stack = Stack(loop, tokenizer, tiny_model_dir)
    stack.wait_serving()
    yield stack
    stack.close()


@pytest.mark.parametrize(("method", "payload"), MALFORMED)
def test_malformed_bytes_are_invalid_argument_without_exception_text(open_stack: Stack, method: str,
                                                                     payload: bytes) -> None:
    """Before: UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>: ..."."""
    with grpc.insecure_channel(open_stack.address) as channel:
        path = f"/tandem.v1.GenerationService/{method}"
        call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)
        with pytest.raises(grpc.RpcError) as info:
            result = call(payload, timeout=5)
            if method == "Generate":
                list(result)
        error = info.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "class" not in error.details() and "Error" not in error.details()
        assert method in error.details()
    with TandemClient(open_stack.address) as client:  # the server carries on
        assert collect(client.generate(token_ids=[5, 6], max_tokens=2, timeout=10))[0]["finish_reason"]
