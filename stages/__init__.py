"""opd-stages: on-policy distillation as content-addressed pipeline stages."""

# First, before any module of this package (or the caller) imports torch: MKL reads MKL_CBWR once,
# when it initialises, and only strict reproducibility makes CPU results independent of the thread
# count and of memory alignment (stages/blocks/reproducible.py says why). Every entry point (`opd`,
# `python -m stages...`, the test suites, the benchmarks) imports this package before torch.
from .blocks.reproducible import set_env as _set_env

_set_env()

__version__ = "0.1.0"
