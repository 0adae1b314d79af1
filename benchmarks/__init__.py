"""The benchmark suites: `python -m benchmarks.run SUITE` (docs/benchmarks.md)."""
