"""Fixtures of the router integration tests (defined in harness.py)."""

from tests.integration.router.harness import mesh, tokenizer

__all__ = ["mesh", "tokenizer"]
