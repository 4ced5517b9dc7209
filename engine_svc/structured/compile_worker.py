"""A grammar compile process: `python -m engine_svc.structured.compile_worker`, started and fed by
compile_farm.py.

It talks to its parent over stdin / stdout in frames (`write_frame`: a tag byte, a 4-byte big-endian
length, the payload): the parent sends `S` once (JSON: the vocabulary as xgrammar's serialized
`TokenizerInfo`), the process answers `R` when its compiler is ready; then, one at a time, `C` (JSON:
`[kind, text]`, a `compiler.Key`) is answered with `G` (the compiled grammar, xgrammar's JSON form) or
`E` (the reason it does not compile). The process imports xgrammar and nothing of the engine's serving
path; it exits when its stdin closes, and (Linux) when its parent dies. The parent may stop it
(SIGSTOP / SIGCONT) or kill it at any time: nothing here outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import struct
import sys
from typing import BinaryIO

HEADER = struct.Struct(">cI")
SETUP, READY, COMPILE, GRAMMAR, ERROR = b"S", b"R", b"C", b"G", b"E"


def write_frame(out: BinaryIO, tag: bytes, payload: bytes) -> None:
    out.write(HEADER.pack(tag, len(payload)))
    out.write(payload)
    out.flush()


def read_frame(inp: BinaryIO) -> tuple[bytes, bytes] | None:
    """The next frame, or None at the end of the stream (the other side closed it or died)."""
    header = _read_exactly(inp, HEADER.size)
    if header is None:
        return None
    tag, size = HEADER.unpack(header)
    payload = _read_exactly(inp, size)
    return None if payload is None else (tag, payload)


def _read_exactly(inp: BinaryIO, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = inp.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def main() -> int:
    _die_with_parent()
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the frames' channel
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything printed goes to the engine's log
    inp = sys.stdin.buffer
    frame = read_frame(inp)
    if frame is None or frame[0] != SETUP:
        return 2
    import xgrammar as xgr

    from engine_svc.structured.constraint import compile_key, reason

    info = xgr.TokenizerInfo.deserialize_json(json.loads(frame[1])["tokenizer_info"])
    # cache_enabled=False: the parent's LRU is the cache (see compiler.py)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_frame(out, READY, b"")
    while (frame := read_frame(inp)) is not None:
        kind, text = json.loads(frame[1])
        try:
            compiled = compile_key(compiler, (kind, text))
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
            write_frame(out, ERROR, reason(exc).encode())
            continue
        write_frame(out, GRAMMAR, compiled.serialize_json().encode())
        del compiled
    return 0


if __name__ == "__main__":
    sys.exit(main())
