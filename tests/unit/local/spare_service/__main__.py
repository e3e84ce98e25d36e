"""Prints one JSON line (its pid and ``SPARE_ECHO``, read when it runs, not when imported), then idles."""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    print(json.dumps({"event": "spare_service_running", "pid": os.getpid(), "echo": os.environ.get("SPARE_ECHO")}))
    print("", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
