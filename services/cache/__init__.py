"""The cache admin service (``python -m services.cache``) and the ``meshserve cache`` command.

Stats, flush and warm-up over gRPC (``servicer`` translates, ``admin`` does the work). The Redis
layout itself (key schema, encodings, budgets) is the library :mod:`services.store`.
"""
