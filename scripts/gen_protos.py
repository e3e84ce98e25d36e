"""Generate Python code for protos/ into services/common/pb/ (committed, drift-checked).

protoc writes imports as ``from meshserve.v1 import ...``; we rewrite them to the package path
``services.common.pb.meshserve.v1`` so the generated modules import without touching sys.path.

Usage: python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE = "services.common.pb"
_IMPORT = re.compile(r"^(from|import) meshserve\.", re.MULTILINE)
_QUALIFIED = re.compile(r"(?<![\w.])meshserve\.(v1|internal)\b")


def _plugin(name: str) -> str:
    """mypy-protobuf's plugins live beside this interpreter (the venv's bin/), which may not be on PATH."""
    candidate = Path(sys.executable).parent / name
    found = candidate if candidate.exists() else shutil.which(name)
    if not found:
        sys.exit(f"{name} not found; install the dev dependencies with `make setup`")
    return str(found)


def generate(out: Path) -> None:
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTOS}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            *files,
        ]
        if protoc.main(args) != 0:
            sys.exit("protoc failed")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        (out / "__init__.py").write_text('"""Generated protobuf code. Do not edit: run `make proto`."""\n')
        for src in sorted(Path(tmp).rglob("*")):
            rel = src.relative_to(tmp)
            dst = out / rel
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                (dst / "__init__.py").touch()
                continue
            text = src.read_text()
            text = _IMPORT.sub(lambda m: f"{m.group(1)} {PACKAGE}.meshserve.", text)
            if src.suffix == ".pyi":
                text = _QUALIFIED.sub(lambda m: f"{PACKAGE}.meshserve.{m.group(1)}", text)
            dst.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "services" / "common" / "pb")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
