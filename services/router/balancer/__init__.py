"""The router's load balancer: which tier and which replica serve a turn, the admission queue before
them, the streams to the workers and what happens when one fails.

It knows requests only as the router's domain types (services/router/types.py) and never imports the
front end (services/router/frontend/, checked by ``make layering``): the front end calls it.
"""
