"""Helpers for tests, the demo and benchmarks: product code never imports this package."""
