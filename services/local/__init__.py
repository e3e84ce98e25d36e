"""The local mesh: ``meshserve up`` (``mesh``, ``up``), child processes (``processes``, ``child``), the
state file (``state``), ``meshserve status`` (``status``), the ``meshserve chat`` client (``client``) and
``meshserve serve|health`` for containers (``launch``). Sits above every service package.
"""
