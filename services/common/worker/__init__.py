"""Worker runtime shared by the edge and cloud tiers.

Domain modules (``types``, ``sampling``, ``detokenizer``, ``stops``, ``stats``, ``admission``,
``runner``) never import grpc; ``servicer`` translates protobuf, ``app`` boots a worker.
"""
