"""Batch API benchmarks: interactive latency while a batch runs (``priority``)."""
