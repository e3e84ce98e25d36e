"""Everything meshserve keeps in Redis, as a library: the one owner of the key schema (``keys``),
value encodings (``response_codec``, ``kv_codec``), byte budgets (``ledger``), fail-open access
(``guard``, ``breaker``), clients (``connection``, ``pipelined``), the response cache
(``response_cache``), KV prefix blocks (``kv_blocks``), the gateway's key and bucket layout
(``gateway_keys``) and the rollout policies the router replicas share (``rollouts``). Used
in-process by the router, gateway, workers and the cache admin service.
No grpc; imports only :mod:`services.common` below it.
"""
