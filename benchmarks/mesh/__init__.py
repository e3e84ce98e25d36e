"""Whole-mesh benchmarks: what the mesh adds over a direct worker call; cancellation."""
