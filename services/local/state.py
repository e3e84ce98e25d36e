"""The state file of the local mesh: where ``meshserve up`` records the addresses of what it started.

``meshserve up`` writes it once the mesh is up and removes it when the mesh stops; the CLI commands
that talk to that mesh read their defaults from it (``meshserve status``: router, cache, metrics;
``meshserve cache``: the cache service; ``meshserve keys``: the mesh's Redis, whose port is chosen at
start). Kept free of grpc and other heavy imports so every command can read it cheaply (the settings
module, which names the file, is imported by every command anyway).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from services.common.config import ClientSettings


def state_path() -> Path:
    """Where ``meshserve up`` records the running mesh's addresses: ``$MESHSERVE_STATE_FILE`` or the cache dir."""
    return ClientSettings().state_path


def write_state(state: dict[str, object]) -> Path:
    """Record ``state``, readable by its owner only (a Redis URL given to ``meshserve up`` may hold a
    password). Written to a temporary file then renamed: a reader never sees a partial file."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
