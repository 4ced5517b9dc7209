"""`make demo`: build a tiny model, start engine + frontend with `tandem serve`, stream three completions
through the public API with `tandem generate`, then stop both services and check nothing is left running.

    python scripts/demo.py [--model-dir .tiny-models/demo]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
PROMPTS = [
    ("The engine schedules requests", []),
    ("Once upon a time, in a small town by the sea,", ["--temperature", "0.8", "--top-p", "0.95", "--seed", "7"]),
    ("def fibonacci(n):", ["--stop", "\n\n"]),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            print(f"  [serve] {line.rstrip()}")
            if "is serving" in line:
                return
        elif proc.poll() is not None:
            raise SystemExit(f"tandem serve exited with {proc.returncode} before it was ready")
    raise SystemExit("tandem serve did not become ready in time")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", default=".tiny-models/demo")
    args = ap.parse_args()
    model = Path(args.model_dir)
    print(f"== building a tiny random-weight model in {model}")
    subprocess.run([BIN / "tandem", "make-tiny-model", str(model), "--arch", "llama", "--num-layers", "4",
                    "--hidden-size", "128", "--seed", "0"], check=True)
    port, engine_port = free_port(), free_port()
    print(f"== tandem serve: frontend on 127.0.0.1:{port}, engine on 127.0.0.1:{engine_port}")
    serve = subprocess.Popen(
        [BIN / "tandem", "serve", "--model", str(model), "--dtype", "float32", "--port", str(port),
         "--engine-port", str(engine_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_ready(serve, timeout=300)
        for prompt, flags in PROMPTS:
            print(f"\n== tandem generate {prompt!r} {' '.join(flags)}")
            subprocess.run([BIN / "tandem", "generate", "--server", f"127.0.0.1:{port}", prompt,
                            "--max-tokens", "48", *flags], check=True)
    finally:
        print("\n== stopping the services (SIGINT: drain, then exit)")
        serve.send_signal(signal.SIGINT)
        out, _ = serve.communicate(timeout=120)
        for line in out.splitlines()[-5:]:
            print(f"  [serve] {line}")
    print(f"tandem serve exited with {serve.returncode}")
    return serve.returncode


if __name__ == "__main__":
    sys.exit(main())
