"""The router's front end: the RouterAPI that callers reach (in process or through the gRPC
servicers), turning requests into the balancer's domain types (tokenizing, tools, generation
defaults, embeddings) and the models, versions and rollouts it serves.

It sits above the load balancer (services/router/balancer/), which it calls and which never imports it.
"""
