"""Generate the Python stubs in duet_wire/ from proto/duet_wire/v1/*.proto.

    python proto/generate.py              # into the repository root (what `make proto` runs)
    python proto/generate.py --out DIR    # into DIR/duet_wire/ (the drift test compares the two)

protoc runs with `-I proto`, so a generated module imports its siblings as
`from duet_wire.v1 import x_pb2` and needs no rewriting. The output depends on the grpcio-tools
version, so this script refuses any version but the pinned one and records it in
duet_wire/GENERATED_BY.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import sys
from pathlib import Path

PINNED_GRPCIO_TOOLS_VERSION = "1.80.1"
PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE = "duet_wire"
VERSION_DIR = "v1"

PACKAGE_INIT = '"""Generated protobuf and gRPC stubs of duet\'s wire contracts (source: proto/). Do not edit."""\n'
VERSION_INIT = '"""duet_wire.v1: generated from proto/duet_wire/v1/*.proto by proto/generate.py. Do not edit."""\n'
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class GenerationError(RuntimeError):
    """protoc failed, or the generator is not the pinned version."""


def generator_version() -> str:
    return importlib.metadata.version("grpcio-tools")


def proto_files() -> list[Path]:
    files = sorted((PROTO_ROOT / PACKAGE / VERSION_DIR).glob("*.proto"))
    if not files:
        raise GenerationError(f"no .proto files under {PROTO_ROOT / PACKAGE / VERSION_DIR}")
    return files


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs, the package __init__ files and GENERATED_BY under out_dir/duet_wire/."""
    from grpc_tools import protoc  # dev dependency: imported only when generating

    version = generator_version()
    if version != PINNED_GRPCIO_TOOLS_VERSION:
        raise GenerationError(
            f"grpcio-tools {version} installed, but the committed stubs are made with "
            f"{PINNED_GRPCIO_TOOLS_VERSION} (pinned in pyproject.toml)"
        )
    package_dir = out_dir / PACKAGE
    version_dir = package_dir / VERSION_DIR
    version_dir.mkdir(parents=True, exist_ok=True)
    # Stale modules of a deleted .proto would otherwise survive a regeneration.
    for stale in version_dir.iterdir():
        if stale.name.endswith(GENERATED_SUFFIXES):
            stale.unlink()

    well_known_types = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known_types}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(path.relative_to(PROTO_ROOT)) for path in proto_files()),
    ]
    status = protoc.main(args)
    if status != 0:
        raise GenerationError(f"protoc exited with status {status}: {' '.join(args)}")

    (package_dir / "__init__.py").write_text(PACKAGE_INIT)
    (version_dir / "__init__.py").write_text(VERSION_INIT)
    (package_dir / "GENERATED_BY").write_text(
        f"grpcio-tools=={version}\nsource: proto/{PACKAGE}/{VERSION_DIR}/*.proto via proto/generate.py\n"
    )
    return sorted(path for path in package_dir.rglob("*") if path.is_file() and "__pycache__" not in path.parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT.parent, help="directory that receives duet_wire/")
    args = parser.parse_args(argv)
    try:
        written = generate(args.out.resolve())
    except GenerationError as error:
        print(f"proto/generate.py: {error}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} files under {args.out.resolve() / PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
