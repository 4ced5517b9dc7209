"""The tokenizer files an engine serves to frontends (`GetTokenizer`), read once, as bytes.

This is the one place the engine reads its model's tokenizer files, and it never parses them: it packs
them into the archive of shared_runtime/tokenizer_bundle.py so that a frontend needs no model files of
its own. The engine still needs no tokenizer to serve requests.

- A Hugging Face directory: the tokenizer, chat-template and config files that exist
  (`tokenizer_bundle.FILE_NAMES`); there is nothing to serve without tokenizer.json.
- A .gguf file: its metadata without tensors (tokenizer, chat template and limits live there).

`stream_tokenizer` serves it (`GetTokenizer`) in chunks of at most `tokenizer_bundle.CHUNK_BYTES`, the total
size on the first and the SHA-256 on the last, to at most `--max-tokenizer-downloads` callers at once
(stream_cap.py; both protocols together).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb

from engine_svc.api.stream_cap import StreamCap
from shared_runtime import tokenizer_bundle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerArchive:
    data: bytes
    sha256: str  # hex
    names: tuple[str, ...]  # the files it holds, sorted

    def chunks(self) -> Iterator[tuple[bytes, bool, bool]]:
        """The archive as GetTokenizer messages carry it (both engine protocols): (piece, first, last),
        pieces of at most `tokenizer_bundle.CHUNK_BYTES`; an empty archive is one empty first-and-last piece."""
        data, size = self.data, tokenizer_bundle.CHUNK_BYTES
        for start in range(0, max(1, len(data)), size):
            yield data[start:start + size], start == 0, start + size >= len(data)


def read_tokenizer_archive(model: str | Path) -> TokenizerArchive | None:
    """The archive of the model's tokenizer files, or None when the model has no tokenizer to serve."""
    files = _tokenizer_files(Path(model))
    if files is None:
        return None
    data = tokenizer_bundle.pack(files)
    archive = TokenizerArchive(data, tokenizer_bundle.sha256_hex(data), tuple(sorted(files)))
    logger.info("serving tokenizer files %s (%d bytes, sha256 %s)", ", ".join(archive.names), len(data),
                archive.sha256[:16])
    return archive


def _tokenizer_files(path: Path) -> dict[str, bytes] | None:
    from engine_svc.model import gguf

    if gguf.is_gguf(path):
        if not gguf.read_metadata(path, ["tokenizer.ggml.tokens"]):
            return None
        return {tokenizer_bundle.GGUF_NAME: gguf.metadata_only(path)}
    files = {name: (path / name).read_bytes() for name in sorted(tokenizer_bundle.FILE_NAMES)
             if name != tokenizer_bundle.GGUF_NAME and (path / name).is_file()}
    return files if "tokenizer.json" in files else None


async def stream_tokenizer(archive: asyncio.Future[TokenizerArchive | None] | None, model_name: str,
                           context: grpc.aio.ServicerContext,
                           cap: StreamCap | None = None) -> AsyncIterator[pb.TokenizerChunk]:
    """GetTokenizer: the archive in chunks; NOT_FOUND without one; RESOURCE_EXHAUSTED past `cap`."""
    if cap is not None and not cap.take(context):
        return
    try:
        found = await archive if archive is not None else None
        if found is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details("this engine's model has no tokenizer files to serve (no tokenizer.json, or a "
                                ".gguf file without a tokenizer); start the frontend with --model")
            return
        for piece, first, last in found.chunks():
            yield pb.TokenizerChunk(data=piece, total_size=len(found.data) if first else 0,
                                    model_name=model_name if first else "", sha256=found.sha256 if last else "")
    finally:
        if cap is not None:
            cap.give_back()
