"""The committed duet_wire/ stubs are exactly what proto/generate.py makes from proto/ (no drift),
and every generated module imports."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "duet_wire"


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_regenerated_stubs_are_byte_identical_to_the_committed_ones(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    fresh = _files(tmp_path / "duet_wire")
    committed = _files(COMMITTED)
    assert sorted(fresh) == sorted(committed), "generated file set differs; run `make proto`"
    drifted = [name for name in fresh if fresh[name] != committed[name]]
    assert not drifted, f"stale generated files {drifted}; run `make proto` and commit the result"


def test_generator_version_is_recorded_and_pinned() -> None:
    recorded = (COMMITTED / "GENERATED_BY").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    version = recorded.splitlines()[0].removeprefix("grpcio-tools==")
    assert f'"grpcio-tools=={version}"' in pyproject


def test_no_python_package_is_named_proto() -> None:
    assert not (REPO / "proto" / "__init__.py").exists()
    assert not list((REPO / "proto").rglob("__init__.py"))


@pytest.mark.parametrize(
    "module",
    sorted(
        f"duet_wire.v1.{path.stem}"
        for path in (COMMITTED / "v1").glob("*.py")
        if path.stem != "__init__"
    ),
)
def test_every_generated_module_imports(module: str) -> None:
    imported = importlib.import_module(module)
    assert imported.__name__ == module


def test_services_and_messages_are_where_the_code_expects_them() -> None:
    from duet_wire.v1 import client_pb2, client_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc

    kv_service = kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"]
    assert [m.name for m in kv_service.methods] == ["Prepare", "Push", "Commit", "Abort"]
    push = kv_service.methods_by_name["Push"]
    assert push.client_streaming and not push.server_streaming
    assert hasattr(kv_transfer_pb2_grpc, "KvTransferServicer")

    client_service = client_pb2.DESCRIPTOR.services_by_name["Duet"]
    assert [m.name for m in client_service.methods] == ["Generate", "Abort", "GetRequest", "ClusterStatus"]
    assert client_service.methods_by_name["Generate"].server_streaming
    assert hasattr(client_pb2_grpc, "DuetServicer")

    # Presence where 0 is meaningful (temperature 0 = greedy, seed 0 is a seed).
    params = client_pb2.SamplingParams()
    assert not params.HasField("temperature") and not params.HasField("seed")
    params.temperature = 0.0
    params.seed = 0
    assert params.HasField("temperature") and params.HasField("seed")
    request = client_pb2.GenerateRequest(token_ids=client_pb2.TokenIds(ids=[1, 2, 3]))
    assert request.WhichOneof("prompt") == "token_ids"


def test_every_message_and_field_is_documented() -> None:
    """The contracts carry a comment on every message, field, enum value and service method."""
    from duet_wire.v1 import client_pb2, kv_transfer_pb2

    for module in (client_pb2, kv_transfer_pb2):
        proto_path = REPO / "proto" / module.DESCRIPTOR.name
        lines = proto_path.read_text().splitlines()
        undocumented = []
        for index, line in enumerate(lines):
            stripped = line.strip()
            if not stripped or stripped.startswith(("//", "}", "syntax", "package", "import", "option")):
                continue
            if stripped.endswith(("{", ";", "{}")):
                previous = lines[index - 1].strip() if index else ""
                if not previous.startswith("//"):
                    undocumented.append(f"{proto_path.name}:{index + 1}: {stripped}")
        assert not undocumented, "\n".join(undocumented)
