"""A stand-in service for the warm-spare test (test_supervise.py): ``python -m tests.unit.local.spare_service``."""
