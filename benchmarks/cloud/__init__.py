"""Cloud tier benchmarks: the engine on CPU and GPU, speculative decoding, tensor parallelism."""
