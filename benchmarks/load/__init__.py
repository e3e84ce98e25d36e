"""Load generation (open/closed loop), soak runs and their reports."""
