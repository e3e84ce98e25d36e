"""Cache benchmarks: our Redis layer against raw redis-py, exact-hit TTFT."""
