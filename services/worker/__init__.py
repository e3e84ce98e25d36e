"""Worker runtime shared by the edge and cloud tiers (``services.edge_worker``, ``services.gpu_worker``).

Domain modules (``types``, ``sampling``, ``detokenizer``, ``stops``, ``stats``, ``slots``,
``runner``) never import grpc; ``servicer`` translates protobuf, ``app`` boots a worker.
"""
