"""Benchmarks; each module is runnable (`python -m bench.<name>`) and writes bench/results/<name>.md."""
