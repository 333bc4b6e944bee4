"""Benchmarks, run from a checkout: ``python -m bench --list`` names the routines, ``python -m bench --routine NAME``
(or ``python -m bench.NAME``) runs one. Each routine module has ``parser()`` and ``main(argv) -> int`` and is run
with tiny arguments by a test; ``bench/_driver.py`` describes the convention."""
