"""`specdec bench`: does speculation pay on this model, prompt mix and machine, and why."""
from .runner import BenchConfig, run_benchmark

__all__ = ["BenchConfig", "run_benchmark"]
