"""A headless worker node (`tandem-engine --headless --node-rank k`): this node's ranks, fed by node 0.

It connects to node 0's node link (engine_svc/executor/nodes.py), is accepted once its flags match node
0's (a refusal names the differing flags; exit 1), spawns its ranks with the same
`MultiprocExecutor` node 0 uses (limited to this node's ranks), and relays: commands from the link into
its shared-memory ring, the answer rank's answers (when it lives here) back over the link. Exit 0 after
SHUTDOWN; exit 1 when the link closes first or a local worker dies (after reporting why in a FAILURE
frame), so that an orchestrator restarts the group.
"""

from __future__ import annotations

import contextlib
import sys
from multiprocessing.connection import wait
from typing import Any

from engine_svc.config import EngineConfig
from engine_svc.executor.codec import Op, decode_command
from engine_svc.executor.multiproc import MultiprocExecutor, WorkerDiedError
from engine_svc.executor.nodes import (
    ANSWER,
    COMMAND,
    FAILURE,
    LinkClosed,
    connect_to_engine,
    recv_frame,
    send_frame,
)


def run_headless(config: EngineConfig) -> int:
    """A worker node: spawn this node's ranks, relay commands in and answers out until the engine says
    SHUTDOWN (exit 0) or anything fails (exit 1). Never serves an API."""
    try:
        sock = connect_to_engine(config)
    except RuntimeError as exc:
        print(f"tandem-engine --headless: {exc}", file=sys.stderr)
        return 1
    executor = MultiprocExecutor(config)
    try:
        while True:
            waitables: list[Any] = [sock, *(p.sentinel for p in executor._procs)]
            if executor._answers is not None:
                waitables.append(executor._answers)
            ready = wait(waitables)
            if executor._answers is not None and executor._answers in ready:
                try:
                    data = executor._answers.recv_bytes()
                except (EOFError, OSError):
                    executor._fail()  # the answering worker is gone: report why
                send_frame(sock, ANSWER, data)
                continue
            if sock in ready:
                try:
                    kind, payload = recv_frame(sock)
                except LinkClosed:
                    return 1  # the engine is gone without a SHUTDOWN
                if kind != COMMAND:
                    continue
                shutting_down = decode_command(memoryview(payload))[0] is Op.SHUTDOWN
                executor._call(payload)
                if shutting_down:
                    return 0
                continue
            executor._fail()  # a local worker died: raises WorkerDiedError with the reasons
    except WorkerDiedError as exc:
        with contextlib.suppress(OSError):
            send_frame(sock, FAILURE, str(exc).encode())
        return 1
    except (OSError, EOFError):
        return 1
    finally:
        executor.shutdown()
        sock.close()
