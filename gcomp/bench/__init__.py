"""Benchmarks: codec speed (``gcomp.bench.codec``) and, later, the training harness behind ``gcomp bench``."""
