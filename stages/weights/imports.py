"""Third-party imports without the import-time work this process does not need
(docs/architecture.md, "Startup"). Each function imports one library the way transformers or peft
would, with one costly piece of its import deferred to where it is first used; nothing computed
changes. Call each before the process's first import of the library (a no-op after it)."""
from __future__ import annotations

import importlib.util
import sys

import torch


def bitsandbytes() -> None:
    """Import bitsandbytes (when installed and not imported yet) with its import-time torch.compile
    calls made lazy. bitsandbytes 0.50 wraps four of its default (CPU) kernels in torch.compile as it is imported,
    and torch.compile imports Inductor on the spot (most of a second on a 2-core CPU). peft
    imports bitsandbytes whenever it is installed, so every training process paid that, quantized
    or not, though nothing in it compiles on the default path. Each wrapper now makes its compiled
    function at its first call instead, which is when torch.compile compiles anyway. Call it before
    the process's first import of peft or bitsandbytes."""
    if "bitsandbytes" in sys.modules or importlib.util.find_spec("bitsandbytes") is None:
        return
    import functools

    real = torch.compile

    def lazy(fn=None, **kw):
        if fn is None:  # used as @torch.compile(**kw)
            return lambda f: lazy(f, **kw)
        made = []

        @functools.wraps(fn)
        def first_call(*a, **k):
            if not made:
                made.append(real(fn, **kw))
            return made[0](*a, **k)
        return first_call

    torch.compile = lazy
    try:
        import bitsandbytes  # noqa: F401
    finally:
        torch.compile = real


def transformers_generation() -> None:
    """Import transformers' generation code (every model class's GenerationMixin) with its
    scikit-learn import deferred. transformers before 5.24 imports `sklearn.metrics.roc_curve` as
    `generation/candidate_generator.py` is imported, wherever scikit-learn is installed, for
    assisted generation's adaptive confidence threshold alone; that import brings in scipy too,
    seconds of a fresh process's first update (docs/performance.md). 5.24 imports it where it is
    used; this does the same for older versions (`_seeing_none`)."""
    name = "transformers.generation.candidate_generator"
    if name in sys.modules or importlib.util.find_spec("sklearn") is None:
        return
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):  # (5.24 imports it lazily itself)
        _seeing_none("is_sklearn_available", name, "roc_curve", "sklearn.metrics")


def transformers_losses() -> None:
    """Import transformers' loss modules (modeling_utils imports them all, for every model class)
    with their scipy import deferred (`_seeing_none`). Six of them, the object-detection losses (DETR
    and its kin), import `scipy.optimize.linear_sum_assignment` as they are imported, wherever scipy
    is installed, for their Hungarian matchers alone: a part of a second of the first update's main
    thread (docs/performance.md; `benchmarks/first_update.py --explain` shows it under
    `<module> (transformers/loss/loss_for_object_detection`). A matcher still checks for scipy as it
    is built, through transformers' own backend table."""
    name = "transformers.loss.loss_utils"
    if name not in sys.modules and importlib.util.find_spec("scipy") is not None:
        _seeing_none("is_scipy_available", name, "linear_sum_assignment", "scipy.optimize")


def _seeing_none(check: str, module: str, attr: str, source: str) -> None:
    """Import `module` while transformers.utils' availability `check` says no, so the modules imported
    meanwhile skip their `from source import attr`; then each module that bound the stand-in gets
    the real check back and an `attr` that imports source's at its first call."""
    import transformers.utils as tu

    real, before = getattr(tu, check), set(sys.modules)

    def absent() -> bool:  # what each module's `from ..utils import check` binds while importing
        return False

    setattr(tu, check, absent)
    try:
        importlib.import_module(module)
    finally:
        setattr(tu, check, real)

    def deferred(*a, **k):
        return getattr(importlib.import_module(source), attr)(*a, **k)

    for mod in (sys.modules[n] for n in set(sys.modules) - before):
        if getattr(mod, check, None) is absent:
            setattr(mod, check, real)
            if not hasattr(mod, attr):
                setattr(mod, attr, deferred)


def transformers() -> None:
    """transformers' model classes imported with both deferrals above; call before the process's first
    import of a model class (models.load, models.materialize)."""
    transformers_losses()
    transformers_generation()
