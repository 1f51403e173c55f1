"""Benchmarks (``ray-moe bench ...``): each submodule exposes ``main(argv) -> int``."""
