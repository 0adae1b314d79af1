"""The worker/PS runtime: scheduling, windows, pushes, steps, records and counters."""
