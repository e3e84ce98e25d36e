"""Edge worker: the INT4 ONNX model served with onnxruntime-genai."""
