"""The state file of the local mesh: where ``meshserve up`` records the addresses of what it started.

``meshserve up`` writes it once the mesh is up and removes it when the mesh stops; the CLI commands
that talk to that mesh read their defaults from it (``meshserve status``: router, cache, metrics;
``meshserve cache``: the cache service; ``meshserve keys``: the mesh's Redis, whose port is chosen at
start). Kept free of grpc and other heavy imports so every command can read it cheaply.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def state_path() -> Path:
    """Where ``meshserve up`` records the running mesh's addresses: ``$MESHSERVE_STATE_FILE`` or the cache dir."""
    env = os.environ.get("MESHSERVE_STATE_FILE")
    return Path(env) if env else Path.home() / ".cache" / "meshserve" / "mesh.json"


def write_state(state: dict[str, object]) -> Path:
    """Record ``state``, readable by its owner only (a Redis URL given to ``meshserve up`` may hold a password)."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a fresh file, so the mode below applies
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(json.dumps(state, indent=2) + "\n")
    return path


def read_state() -> dict[str, object]:
    """The running local mesh's recorded state; empty when no mesh is up (or the file is unreadable)."""
    try:
        state = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def recorded(name: str) -> str:
    """One recorded address or URL (``gateway``, ``router``, ``cache``, ``redis``); "" when not recorded."""
    value = read_state().get(name, "")
    return value if isinstance(value, str) else ""
