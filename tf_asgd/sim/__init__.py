"""A NumPy simulator of N asynchronous workers (16 to 100 workers, no cluster)."""
