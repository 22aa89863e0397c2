"""Benchmarks: each writes JSON and a PNG into bench/results/ (see each module\x27s docstring)."""
