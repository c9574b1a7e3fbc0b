"""Example models and training scripts (the demo and the benchmarks use them)."""
