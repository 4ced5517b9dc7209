"""A frontend without --model: its tokenizer files come from the engines it serves (`GetTokenizer`).

`fetch_engine_tokenizer` resolves the engine targets, asks every engine for its tokenizer archive
(shared_runtime/tokenizer_bundle.py), retrying until at least one answers (engines may still be
starting), then gives the others `settle_s` to answer too. Every answer must be the same archive and
model name, or the frontend refuses to start with a message naming the engines and the files that
differ. `write_tokenizer_dir` puts the files in a fresh directory that the rest of the frontend loads
exactly as it loads a --model directory. Engines that join later are checked against the archive's
checksum when they connect (engines/client.py).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from frontend_svc.engines.client import ChannelFactory, dns_target_host, is_dns_target, resolve_target
from shared_runtime import tokenizer_bundle

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0
RETRY_S = 1.0
SETTLE_S = 3.0  # after the first answer, how long the other engines get to answer before the start goes on


class TokenizerFetchError(Exception):
    """No usable tokenizer could be fetched, or the engines disagree; the message says which and why."""


@dataclass(frozen=True)
class FetchedTokenizer:
    files: dict[str, bytes]
    sha256: str
    model_name: str
    address: str  # the engine it came from

    @property
    def is_gguf(self) -> bool:
        return tokenizer_bundle.GGUF_NAME in self.files


async def fetch_engine_tokenizer(targets: Sequence[str], channels: ChannelFactory, timeout_s: float,
                                 settle_s: float = SETTLE_S) -> FetchedTokenizer:
    """The tokenizer every engine of `targets` serves; TokenizerFetchError when none answers within
    `timeout_s`, one has no tokenizer, or they disagree."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    answers: dict[str, FetchedTokenizer] = {}
    failures: dict[str, str] = {}
    first_answer_at: float | None = None
    while True:
        addresses = await loop.run_in_executor(None, _resolve_all, targets)
        pending = [a for a in addresses if a not in answers]
        results = await asyncio.gather(*(_fetch_one(a, addresses[a], channels) for a in pending),
                                       return_exceptions=True)
        for address, result in zip(pending, results):
            if isinstance(result, FetchedTokenizer):
                answers[address] = result
                failures.pop(address, None)
            elif isinstance(result, TokenizerFetchError):
                raise result
            else:
                failures[address] = str(result)
        now = time.monotonic()
        if answers and first_answer_at is None:
            first_answer_at = now
        if answers and (len(answers) == len(addresses) or now >= first_answer_at + settle_s):  # type: ignore[operator]
            break
        if now >= deadline:
            detail = "; ".join(f"{a}: {why}" for a, why in sorted(failures.items())) or "no engine address resolved"
            raise TokenizerFetchError(f"no engine served its tokenizer within {timeout_s:.0f}s ({detail}); "
                                      "check --engine, or start the frontend with --model")
        await asyncio.sleep(RETRY_S)
    if failures:
        logger.warning("engines that did not answer GetTokenizer yet are checked when they connect: %s",
                       ", ".join(sorted(failures)))
    return agreed(answers)


def agreed(answers: dict[str, FetchedTokenizer]) -> FetchedTokenizer:
    """The one tokenizer all answers share; TokenizerFetchError naming two engines and what differs."""
    first, *rest = (answers[a] for a in sorted(answers))
    for other in rest:
        if other.sha256 == first.sha256 and other.model_name == first.model_name:
            continue
        what = [f"file {name}" for name in tokenizer_bundle.differences(first.files, other.files)]
        if other.model_name != first.model_name:
            what.append(f"model name ({first.model_name!r} vs {other.model_name!r})")
        raise TokenizerFetchError(
            f"the engines serve different tokenizers: {first.address} and {other.address} differ in "
            f"{', '.join(what)}; serve the same model on every engine, or start the frontend with --model")
    logger.info("tokenizer of %r fetched from %d engine(s) (%s; sha256 %s)", first.model_name, len(answers),
                ", ".join(sorted(first.files)), first.sha256[:16])
    return first


def write_tokenizer_dir(fetched: FetchedTokenizer) -> Path:
    """Write the files into a new temporary directory; returns what --model would have named: the
    directory, or the metadata-only .gguf file in it."""
    out = Path(tempfile.mkdtemp(prefix="tandem-tokenizer-"))
    for name, data in fetched.files.items():  # names are tokenizer_bundle.FILE_NAMES only (unpack checks)
        (out / name).write_bytes(data)
    return out / tokenizer_bundle.GGUF_NAME if fetched.is_gguf else out


def _resolve_all(targets: Sequence[str]) -> dict[str, str | None]:
    """Every engine address of the targets -> the name its TLS certificate must carry (None: its host)."""
    addresses: dict[str, str | None] = {}
    for target in targets:
        try:
            found = resolve_target(target)
        except OSError as exc:
            logger.warning("cannot resolve engine target %s: %s", target, exc)
            continue
        name = dns_target_host(target) if is_dns_target(target) else None
        addresses.update(dict.fromkeys(found, name))
    return addresses


async def _fetch_one(address: str, server_name: str | None, channels: ChannelFactory) -> FetchedTokenizer:
    """One engine's archive, unpacked and checked; TokenizerFetchError when it has none or sends a bad one,
    grpc.aio.AioRpcError when it cannot be reached (retried by the caller)."""
    channel = channels(address, server_name)
    try:
        stub = epb_grpc.EngineCoreServiceStub(channel)
        data, sha256, model_name = bytearray(), "", ""
        try:
            async for chunk in stub.GetTokenizer(epb.GetTokenizerRequest(), timeout=CALL_TIMEOUT_S):
                data += chunk.data
                sha256 = chunk.sha256 or sha256
                model_name = chunk.model_name or model_name
                if len(data) > tokenizer_bundle.MAX_ARCHIVE_BYTES:
                    raise TokenizerFetchError(f"engine {address} sent a tokenizer archive larger than "
                                              f"{tokenizer_bundle.MAX_ARCHIVE_BYTES} bytes")
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                raise TokenizerFetchError(f"engine {address} serves no tokenizer ({exc.details()}); "
                                          "start the frontend with --model") from None
            raise
        try:
            files = tokenizer_bundle.unpack(bytes(data), sha256)
        except tokenizer_bundle.BundleError as exc:
            raise TokenizerFetchError(f"engine {address}: {exc}") from None
        return FetchedTokenizer(files, sha256, model_name, address)
    finally:
        await channel.close(grace=None)
