"""Front-door benchmarks: what the gateway, router, Envoy and tracing add; rate limiter; LiteLLM comparison."""
