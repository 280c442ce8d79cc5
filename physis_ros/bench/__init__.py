"""Benchmarks behind ``physis-bench``; each writes JSON (and a plot where one helps)."""
