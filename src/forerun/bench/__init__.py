"""Benchmark harness: real datasets, interleaved runs against plain `model.generate`, tables, JSON and plots."""
