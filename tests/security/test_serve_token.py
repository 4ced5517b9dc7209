"""`tandem serve` keeps the engine port closed to everyone but its frontend (issue 22): before, with
`--api-key` on the public port, any local process could `Connect` to the engine and generate, bypassing
keys, admission and validation; and the API keys showed on the frontend's command line in `ps`."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import grpc
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from frontend_svc.client import TandemClient
from tests.support import Service, free_port, rpc_error

pytestmark = pytest.mark.slow
KEY = "serve-test-key-3f9a"


def children(pid: int) -> list[int]:
    out = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat_file.parent.name))
    return out


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_the_engine_under_serve_refuses_a_client_without_the_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    port, engine_port = free_port(), free_port()
    serve = Service("serve", [sys.executable, "-m", "entrypoints.serve", "--model", str(tiny_model_dir),
                              "--port", str(port), "--engine-port", str(engine_port), "--http-port", "0",
                              "--api-key", KEY, "--dtype", "float32"], port, tmp_path).start()
    token_dir = None
    try:
        serve.wait_serving(120)
        assert serve.proc is not None
        kids = children(serve.proc.pid)
        lines = [cmdline(pid) for pid in kids]
        assert len(lines) == 2 and all(KEY not in " ".join(line) for line in lines)  # nothing in `ps`
        engine_line = next(line for line in lines if "engine_svc.cli" in line)
        token_file = Path(engine_line[engine_line.index("--engine-token-file") + 1])
        token_dir = token_file.parent
        assert stat.S_IMODE(token_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32

        with grpc.insecure_channel(f"127.0.0.1:{engine_port}") as channel:
            stub = epb_grpc.EngineCoreServiceStub(channel)
            for metadata in ((), (("authorization", "Bearer not-the-token"),), (("authorization", f"Bearer {KEY}"),)):
                error = rpc_error(lambda m=metadata: stub.GetEngineInfo(epb.GetEngineInfoRequest(), metadata=m,
                                                                        timeout=10))
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                add = epb.EngineCoreInput(add=epb.EngineCoreRequest(request_id="intruder", prompt_token_ids=[5, 6]))
                error = rpc_error(lambda m=metadata, a=add: list(stub.Connect(iter([a]), metadata=m, timeout=10)))
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            info = stub.GetEngineInfo(epb.GetEngineInfoRequest(), metadata=(("authorization", f"Bearer {token}"),),
                                      timeout=10)
            assert info.max_model_len > 0

        with TandemClient(f"127.0.0.1:{port}", api_key=KEY) as client:  # the frontend holds the token
            out = list(client.generate(token_ids=[5, 6, 7], max_tokens=3, timeout=30))
            assert out[-1].finish_reason
    finally:
        code = serve.stop()
    assert code == 0, serve.log()
    assert token_dir is not None and not token_dir.exists()  # removed at exit
