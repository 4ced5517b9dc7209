"""Regenerate the Python code of tandem's protos, or check that the committed code is fresh.

    python scripts/gen_protos.py           # write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py next to each .proto
    python scripts/gen_protos.py --check   # regenerate into a temp dir; exit 1 if protos/ differs

Generation runs `grpc_tools.protoc -I protos` so that generated imports read `from tandem.v1 import ...`
(the package `tandem` is `protos/tandem`). The output depends on the grpcio-tools version (it stamps
its protobuf/grpc versions into the files), so --check is meaningful only with the pinned dev tools.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under root, as paths relative to it, sorted (so output order is stable)."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generated_files(root: Path) -> set[Path]:
    """Every generated file under root, relative to it."""
    return {
        p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> None:
    """Run protoc over every .proto under root, writing Python, stubs and gRPC code into out_dir."""
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in proto_files(root)),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see the errors above)")


def stale_files(root: Path = PROTO_ROOT) -> list[str]:
    """Regenerate into a temp dir and list the generated files under root that are missing,
    different, or left over from a deleted .proto. Empty means fresh."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root, root)
        expected = generated_files(fresh_root)
        actual = generated_files(root)
        problems = [f"missing: {p}" for p in sorted(expected - actual)]
        problems += [f"extra:   {p}" for p in sorted(actual - expected)]
        problems += [
            f"stale:   {p}"
            for p in sorted(expected & actual)
            if not filecmp.cmp(fresh_root / p, root / p, shallow=False)
        ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed generated code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(PROTO_ROOT)
        print(f"generated code for {len(proto_files())} proto file(s) under {PROTO_ROOT}")
        return 0
    problems = stale_files()
    if problems:
        print("generated protobuf code is stale; run `make protos`:", *problems, sep="\n  ", file=sys.stderr)
        return 1
    print("generated protobuf code is fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
