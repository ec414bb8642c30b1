"""Benchmarks of the taskflow core; see bench/README.md."""
