"""Where a worker's model is: the one state type of the worker (services/worker/sleep.py moves it), the
router (services/router registry and wake: only an awake replica is routed to) and ``meshserve status``.

No transport here: services/common/model_state_pb.py converts it to and from
``meshserve.internal.v1.ModelState`` at the service edges. The values are the names the router logs.
"""

from __future__ import annotations

import enum


class ModelState(enum.Enum):
    """``AWAKE`` -> ``FALLING_ASLEEP`` (the engine releases its model) -> ``ASLEEP`` -> ``WAKING`` (the
    engine loads it again) -> ``AWAKE``."""

    AWAKE = "awake"
    ASLEEP = "asleep"
    WAKING = "waking"
    FALLING_ASLEEP = "falling_asleep"
