"""
nvproxy benchmarks: the same workload direct to a fake engine and through
nvproxy, side by side in one run.  Run with C{python -m bench.run}.
"""
