"""lossscale's benchmarks (not tests): ``python -m benchmarks [--quick] [--json PATH]``.

One command runs the NumPy, PyTorch and JAX benchmarks (each in its own process, each
comparison timed in one interleaved run), prints one table and writes one JSON file. See
``benchmarks/run.py``. Nothing here is part of the installed package.
"""
