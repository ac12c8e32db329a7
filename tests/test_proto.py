"""The committed stubs are what grpcio-tools generates from proto/ today."""

from pathlib import Path

from fedrelay.protogen import generate

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    fresh = generate(tmp_path)
    assert len(fresh) >= 9  # 3 protos x (pb2, pyi, grpc)
    for path in fresh:
        committed = REPO / "fedrelay" / "v1" / path.name
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `make proto`"


def test_protos_are_versioned_package():
    for proto in (REPO / "proto" / "fedrelay" / "v1").glob("*.proto"):
        assert "package fedrelay.v1;" in proto.read_text()
