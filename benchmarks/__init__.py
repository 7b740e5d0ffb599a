"""Benchmarks for `make bench`: figures reported as ratios against baselines from the same run."""
