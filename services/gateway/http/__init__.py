"""OpenAI-compatible HTTP adapter: JSON/SSE over HTTP/1.1 in, the gateway's gRPC Inference API out."""
