"""A frontend without --model: the tokenizer archive (shared_runtime/tokenizer_bundle.py) fetched from the
engines (frontend_svc/tokenizer_fetch.py), against fake engines that serve a model's tokenizer files.

Checked: the fetched files load into the same tokenizer as the model directory; engines serving different
files make the start fail naming both engines and the files that differ (also through the real CLI, which
exits 2); an engine with no tokenizer is named; an engine joining later with another archive is never
routed to; the receiving side refuses archives that are corrupt, mislabelled, too large or carry unknown
names.
"""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from frontend_svc.config import FrontendConfig
from frontend_svc.engines.client import ChannelFactory
from frontend_svc.server import FrontendServer
from frontend_svc.tokenizer import Tokenizer
from frontend_svc.tokenizer_fetch import TokenizerFetchError, fetch_engine_tokenizer, write_tokenizer_dir
from shared_runtime import tokenizer_bundle
from shared_runtime.tokenizer_bundle import BundleError
from tests.fake_engine import FakeEngine, start_fake_engine
from tests.support import ROOT, LoopThread, wait_until

TEXT = "The quick brown fox, ¿qué tal? 12345"


def model_files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in model_dir.iterdir() if p.name in tokenizer_bundle.FILE_NAMES}


@pytest.fixture()
def fakes(loop: LoopThread, tiny_model_dir: Path, tokenizer: Any) -> Iterator[Any]:
    """Start fake engines with the given tokenizer files: `fakes(files, ...)` -> their addresses."""
    servers = []

    def start(*file_sets: dict[str, bytes] | None) -> list[str]:
        addresses = []
        for files in file_sets:
            fake = FakeEngine(vocab_size=tokenizer.vocab_size, tokenizer_files=files, model_name="tiny-served")
            server, port = loop.run(start_fake_engine(fake))
            servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        return addresses

    yield start
    for server in servers:
        loop.run(server.stop(None))


def fetch(loop: LoopThread, addresses: list[str], timeout_s: float = 10.0) -> Any:
    return loop.run(fetch_engine_tokenizer(addresses, ChannelFactory(), timeout_s, settle_s=0.5))


def test_the_fetched_files_load_into_the_models_tokenizer(loop: LoopThread, fakes: Any, tiny_model_dir: Path,
                                                         tokenizer: Any) -> None:
    files = model_files(tiny_model_dir)
    fetched = fetch(loop, fakes(files, files))
    assert fetched.files == files and fetched.model_name == "tiny-served"
    served = Tokenizer.from_pretrained(write_tokenizer_dir(fetched))
    assert served.encode(TEXT) == tokenizer.encode(TEXT)
    assert served.eos_token_ids == tokenizer.eos_token_ids and served.vocab_size == tokenizer.vocab_size
    chat = [{"role": "user", "content": "hi"}]
    assert served.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)


def test_engines_serving_different_files_are_refused_naming_the_difference(loop: LoopThread, fakes: Any,
                                                                          tiny_model_dir: Path) -> None:
    files = model_files(tiny_model_dir)
    other = {**files, "tokenizer_config.json": files["tokenizer_config.json"].replace(b"{{", b"{{- ", 1)}
    first, second = fakes(files, other)
    with pytest.raises(TokenizerFetchError) as info:
        fetch(loop, [first, second])
    message = str(info.value)
    assert first in message and second in message and "tokenizer_config.json" in message
    assert "tokenizer.json" not in message.replace("tokenizer_config.json", "")


def test_an_engine_without_a_tokenizer_is_named(loop: LoopThread, fakes: Any) -> None:
    [address] = fakes(None)
    with pytest.raises(TokenizerFetchError, match=f"engine {address} serves no tokenizer"):
        fetch(loop, [address])


def test_the_cli_refuses_to_start_when_the_engines_disagree(fakes: Any, tiny_model_dir: Path) -> None:
    files = model_files(tiny_model_dir)
    first, second = fakes(files, {**files, "generation_config.json": b'{"eos_token_id": 3}'})
    done = subprocess.run([sys.executable, "-m", "frontend_svc.cli", "--engine", f"{first},{second}",
                           "--port", "0", "--metrics-port", "0", "--host", "127.0.0.1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "generation_config.json" in done.stderr and first in done.stderr and second in done.stderr


def test_an_engine_serving_another_archive_is_not_routed_to(loop: LoopThread, fakes: Any, tiny_model_dir: Path,
                                                           tokenizer: Any) -> None:
    files = model_files(tiny_model_dir)
    same, other = fakes(files, {**files, "config.json": b"{}"})
    fetched = fetch(loop, [same])
    config = FrontendConfig(model=str(write_tokenizer_dir(fetched)), engines=(same, other), host="127.0.0.1",
                            port=0, engine_tokenizer_sha256=fetched.sha256)

    async def start() -> FrontendServer:
        server = FrontendServer(config)
        await server.start()
        return server

    frontend = loop.run(start())
    try:
        wait_until(lambda: [c.address for c in frontend.engines.ready_engines()] == [same], 10, "one ready engine")
        assert [c.state.value for c in frontend.engines.connections() if c.address == other] == ["mismatch"]
    finally:
        loop.run(frontend.stop())


# ---- the archive's guards --------------------------------------------------------------------------------------
def test_the_archive_depends_only_on_the_files() -> None:
    files = {"tokenizer.json": b"{}", "config.json": b'{"a": 1}'}
    assert tokenizer_bundle.pack(files) == tokenizer_bundle.pack(dict(reversed(list(files.items()))))
    assert tokenizer_bundle.pack(files) != tokenizer_bundle.pack({**files, "config.json": b'{"a": 2}'})
    with pytest.raises(BundleError, match=r"weights\.bin"):
        tokenizer_bundle.pack({"weights.bin": b""})


def test_unpack_refuses_bad_archives(monkeypatch: pytest.MonkeyPatch) -> None:
    good = tokenizer_bundle.pack({"tokenizer.json": b"{}"})
    assert tokenizer_bundle.unpack(good, tokenizer_bundle.sha256_hex(good)) == {"tokenizer.json": b"{}"}
    with pytest.raises(BundleError, match="SHA-256"):
        tokenizer_bundle.unpack(good, "0" * 64)
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w") as archive:
        archive.writestr("../../etc/evil", b"x")
    evil = raw.getvalue()
    with pytest.raises(BundleError, match="unexpected entries"):
        tokenizer_bundle.unpack(evil, tokenizer_bundle.sha256_hex(evil))
    with pytest.raises(BundleError, match="not a zip"):
        tokenizer_bundle.unpack(b"junk", tokenizer_bundle.sha256_hex(b"junk"))
    monkeypatch.setattr(tokenizer_bundle, "MAX_ARCHIVE_BYTES", len(good) - 1)
    with pytest.raises(BundleError, match="more than"):
        tokenizer_bundle.unpack(good, tokenizer_bundle.sha256_hex(good))
