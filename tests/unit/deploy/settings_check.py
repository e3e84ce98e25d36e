"""Is an environment variable a real setting? (``MESHSERVE_<SERVICE>_<FIELD>`` of a settings class.)"""

from __future__ import annotations

from pydantic_settings import BaseSettings

from services.batch.config import BatchSettings
from services.cache.config import CacheSettings
from services.common.tracing import TracingSettings
from services.edge_worker.config import EdgeWorkerSettings
from services.gateway.config import GatewaySettings
from services.gateway.http.config import HttpAdapterSettings
from services.gpu_worker.config import GpuWorkerSettings
from services.router.config import RouterSettings

SETTINGS: list[type[BaseSettings]] = [
    GatewaySettings,
    HttpAdapterSettings,  # the front door's adapters (started by `meshserve frontdoor` with its env)
    RouterSettings,
    CacheSettings,
    BatchSettings,
    EdgeWorkerSettings,
    GpuWorkerSettings,
    TracingSettings,
]
NOT_SETTINGS = {"MESHSERVE_MODELS_DIR", "MESHSERVE_TP_SIZE", "PYTHONUNBUFFERED", "POD_NAME", "POD_IP"}
"""Read by the models path helper, the torchrun command line, Python, and $(VAR) expansion."""
_PREFIXES = {cls.model_config["env_prefix"]: cls for cls in SETTINGS}


def check(key: str, where: str) -> None:
    """AssertionError unless ``key`` is a field of the settings class its prefix names."""
    if key in NOT_SETTINGS:
        return
    # Longest prefix first: MESHSERVE_GATEWAY_HTTP_ would otherwise match MESHSERVE_GATEWAY_.
    prefix = next((p for p in sorted(_PREFIXES, key=len, reverse=True) if key.startswith(p)), None)
    assert prefix is not None, f"{where}: {key} belongs to no service"
    field = key.removeprefix(prefix).lower()
    assert field in _PREFIXES[prefix].model_fields, f"{where}: {key} is not a setting of {_PREFIXES[prefix].__name__}"
