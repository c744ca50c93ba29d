"""The settings an `opd` process makes for itself: before torch loads (MKL's reproducibility mode,
malloc's), and the third-party notices it keeps quiet. The CLI's entry point calls both first; tests
and benchmarks call `process_settings()` before importing torch, as `opd` does."""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings

from ..memory import hostmem
from ..run import reproducible

# Third-party notices known to be harmless here, each silenced by its own text (and nothing else):
# - bitsandbytes, at import on an AVX512-BF16 CPU: an optional kernel package is absent (it falls back
#   to its own kernel; we never need the other)
# - transformers' `is_gradient_checkpointing` deprecation: PEFT calls it, not our code
QUIET_LOGS = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community"}
QUIET_WARNINGS = [(FutureWarning, "`is_gradient_checkpointing` is deprecated")]


def quiet_libraries(verbose: bool = False) -> None:
    """Without --verbose: the notices above are dropped, and third-party progress bars (the embedded
    model's GGUF dequantisation, weight loading, hub) are off; ours show on a terminal only."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if verbose:
        return
    for name, text in QUIET_LOGS.items():
        logging.getLogger(name).addFilter(lambda r, text=text: not r.getMessage().startswith(text))
    for category, text in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text), category=category)
    # tqdm reads TQDM_* at import: the GGUF conversion bar (tqdm.auto, not transformers' switch) stays off
    os.environ.setdefault("TQDM_DISABLE", "1")
    # the hub's bars, and transformers', which read it as transformers is imported; transformers is
    # not imported for this (a command that loads no model need not pay for it), only switched off
    # here if something imported it already
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if sys.modules.get("transformers") is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def process_settings() -> None:
    """Set before anything imports torch (MKL reads MKL_CBWR once; malloc's settings must precede torch's
    first allocation): MKL's strict reproducibility mode (run/reproducible.py), freed host memory kept."""
    reproducible.set_env()
    hostmem.keep_freed_memory()


