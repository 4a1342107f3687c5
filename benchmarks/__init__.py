"""Benchmarks of float8 against bf16 and peers, through public APIs only (python -m benchmarks)."""
