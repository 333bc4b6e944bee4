"""Benchmarks. Each module has ``main(argv) -> int`` and is run with tiny arguments by a test."""
