"""Offline benchmarks for cbserve (see benchmarks/throughput.py)."""
