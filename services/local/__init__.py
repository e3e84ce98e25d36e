"""The launcher of the local mesh, what ``meshserve up`` (services/cli/up.py) runs: the mesh
(``mesh``), its Redis servers (``redis_server``), the supervision of its child processes
(``supervise``; the processes themselves: services.common.processes), the scaler (``scaler``), the
state file (``state``) and ``meshserve serve|health`` for containers (``launch``). Sits above every
service package and below services.cli.
"""
