"""Cloud worker: the HF checkpoint served with transformers/torch (CUDA when available)."""
