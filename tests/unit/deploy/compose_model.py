"""Load deploy/compose.yaml as docker compose would: override files, env_file merging, interpolation.

Only what the deploy tests need: ``${VAR}``, ``${VAR:-default}`` and ``${VAR-default}`` interpolation
(from a given environment, never the test process's), env files (KEY=VALUE lines, ``#`` comments),
``environment`` mappings, and the merge of an override file (mappings merged, lists replaced).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_GPU = DEPLOY / "compose.gpu.yaml"
COMPOSE_VERSIONS = DEPLOY / "compose.versions.yaml"
_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            name, op, default = m["name"], m["op"], m["default"]
            if name in env and (env[name] or op != ":-"):
                return env[name]
            if op is None:
                raise KeyError(f"${{{name}}} has no default; compose would substitute an empty string")
            return default

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


def merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    return override


def load(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The merged, interpolated compose document of ``files`` (default: compose.yaml alone)."""
    doc: dict[str, Any] = {}
    for path in files or (COMPOSE,):
        doc = merge(doc, yaml.safe_load(path.read_text()))
    result = interpolate(doc, env or {})
    assert isinstance(result, dict)
    return result


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: line {line!r} is not KEY=VALUE"
        values[key.strip()] = value
    return values


def service_env(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment: its env files in order, then ``environment`` (which wins)."""
    env: dict[str, str] = {}
    files = service.get("env_file", [])
    for name in [files] if isinstance(files, str) else files:
        env.update(read_env_file(DEPLOY / name))
    extra = service.get("environment", {})
    if isinstance(extra, list):
        extra = dict(item.split("=", 1) for item in extra)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command")
    assert isinstance(cmd, list), "commands are exec-form lists (no shell)"
    return [str(c) for c in cmd]


def is_meshserve(service: dict[str, Any]) -> bool:
    """A service of the meshserve image (built here), not a third-party one (redis, prometheus, grafana)."""
    return "build" in service or str(service.get("image", "")).startswith("meshserve:")
