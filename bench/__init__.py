"""Benchmarks: each writes JSON and a PNG into bench/results/ (see the docstring of each module)."""
