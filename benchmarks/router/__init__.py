"""Router benchmarks: decision cost, prefix-aware routing (simulated and with real workers)."""
