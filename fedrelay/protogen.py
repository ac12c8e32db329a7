"""Regenerate the committed gRPC/protobuf stubs from ``proto/`` (``make proto``).

``python -m fedrelay.protogen [OUT]`` writes ``fedrelay/v1/*_pb2*.py(i)`` under OUT (default: the
repository root). The test suite regenerates into a temporary folder and compares, so stale stubs
fail CI. Needs ``grpcio-tools`` (the ``dev`` extra), pinned so that the output is stable.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "fedrelay" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out / "fedrelay" / "v1").glob("*_pb2*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
