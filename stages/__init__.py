"""opd-stages: on-policy distillation as content-addressed pipeline stages."""

# First, before any module of this package (or the caller) imports torch: MKL reads MKL_CBWR once,
# when it initialises, and only strict reproducibility makes CPU results independent of the thread
# count and of memory alignment (stages/run/reproducible.py says why). Every entry point (`opd`,
# `python -m stages...`, the test suites, the benchmarks) imports this package before torch.
from .memory.hostmem import keep_freed_memory as _keep_freed_memory
from .run.reproducible import set_env as _set_env

_set_env()
# Freed host memory stays with the process: large CPU tensors are reused, not faulted in afresh
# (stages/memory/hostmem.py). Before torch allocates anything, so its arenas follow the setting.
_keep_freed_memory()

__version__ = "0.1.0"
