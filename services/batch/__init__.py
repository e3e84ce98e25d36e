"""The batch runner: runs the lines of OpenAI-style batches (services/store/batches.py) through the
router at the lowest priority, in free capacity only, writing each line's result exactly once.
Runs as its own service (``python -m services.batch``), as many replicas as wanted: they share the
work through one Redis Stream consumer group. See docs/batch.md."""
