"""The device bench (autotune/bench.py) in a measuring worker where the kernel languages cannot
be imported, as on a GPU machine that has only the candidates, torch and the CUDA driver
(tests/gpu/test_autotune_measure.py names it). None in sys.modules is how Python marks a module
absent (tests/serving_machine.py)."""
import sys

for _name in ("triton", "tilelang"):
    sys.modules[_name] = None

from deepinfer.autotune.bench import Bench  # noqa: E402


class NoCompilerBench(Bench):
    pass
