"""Reads the first step waits for, started early on one worker thread (docs/architecture.md, "Startup").

A fresh CUDA run's main thread used to read, one after the other: the student's weights and LoRA,
the tokenizer, pandas (pyarrow imports it at the first array it builds from a Python list, to ask
whether the list is a pandas object), and after the first rollout the teacher's weights (mostly
waiting on transformers' loading threads), each a part of a second. `Resident.load_ahead`
starts the worker; once the student's weights and LoRA are in (the order the memory plan assumes),
`Resident.student` gives it the teacher's weights (where the plan keeps both models resident, the
teacher is unquantized, as bitsandbytes' import is not made thread-safe, and no memory.vram_gib
budget is set), then the tokenizer, then pandas, while the main thread publishes policy 0. The
engine's capture joins the teacher's load (no capture sees another thread's device work). The
models' tensors themselves are read from the start, the student's then the teacher's, while the
main thread imports transformers (`weights`: safetensors' reads onto the device, which hold the
interpreter for little more than one call per tensor; `weights_read` says whose), so each model's
load is transformers making it of tensors already on the device (models.load's `weights`; in the
dtype the run computes in, else from the files). Given the teacher while the LoRA was being
built, the LoRA took over twice as long: each of its 448 small host-to-device copies queued on the
one default stream behind the teacher's, whose loading threads also held the interpreter. Read
after it, the teacher makes the engine's capture wait instead, with no gain measured in the first
update (docs/performance.md). Python-bound work does not overlap, the interpreter runs one thread
at a time: started as the session opened, the reads slowed the student's load (its imports, and
module locks the worker held) by about what they saved later.

Nothing here computes anything a run publishes: each job only reads, loading a model draws no random
numbers (tests/test_session.py: the same teacher and policy 0 with the reads as without; on the GPU,
tests/gpu/test_gpu_warmup.py: the same published bytes), and a model dir is read only after its hash
checks out (`verified`); one that fails, or any failure at all, leaves that read to the in-line
path (`take` returns None), which recomputes the dir or reports the error as it always did.
`Resident.before_capture` joins the teacher's reads: no CUDA graph capture sees another thread's
device work.
"""
from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from . import adapters

# The interpreter's switch interval while the construction's threads run (warm-up, reads ahead):
# a thread waiting for the interpreter lock asks the running one to drop it only after this long
# (Python's default: 5 ms), and the main thread gives the lock up at every torch call, so each of
# its hundreds of small calls (building the LoRA, launching a capture's kernels) could wait up to
# the interval behind a thread running Python. Building the student's LoRA beside a thread running
# Python bytecode took 30 times as long at 5 ms as alone, 3.5 times at 0.5 ms and 4 times at 0.1 ms
# (docs/performance.md). Not measured apart on the GPU machine: its first update was measured with it
# (docs/architecture.md, "Startup").
SWITCH_S = 0.0005
_switch_before: list[float] = []


def favour_main_thread() -> None:
    """The short switch interval, until `restore_switch_interval` (the first update's end)."""
    if not _switch_before:
        _switch_before.append(sys.getswitchinterval())
        sys.setswitchinterval(min(_switch_before[0], SWITCH_S))


def restore_switch_interval() -> None:
    if _switch_before:
        sys.setswitchinterval(_switch_before.pop())


class Ahead:
    """Named jobs on one worker thread (first in, first run), their results taken later by name."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[str, Future] = {}
        self.taken: list[str] = []  # the jobs whose results were used (train.json: timings.loaded_ahead)

    def __bool__(self) -> bool:  # started: jobs may be submitted
        return self._pool is not None

    def __contains__(self, name: str) -> bool:  # a job of that name was submitted and not taken yet
        return name in self._jobs

    def start(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="opd-ahead")

    def submit(self, name: str, fn, *args) -> None:
        self._jobs[name] = self._pool.submit(fn, *args)

    def take(self, name: str):
        """The job's result, joined (once); None if no such job was started, or it failed."""
        fut = self._jobs.pop(name, None)
        if fut is None or fut.exception() is not None or fut.result() is None:
            return None
        self.taken.append(name)
        return fut.result()

    def join(self, *names: str) -> None:
        """Wait for the jobs to end, those that were started (their results stay for `take`)."""
        for name in names:
            if name in self._jobs:
                self._jobs[name].exception()


def weights_read(cfg, placement: str) -> list[str]:
    """The models whose weights are read ahead, in the order they load: each where it is unquantized
    (a quantized load reads its files itself; bitsandbytes' import is not made thread-safe) and its
    class is transformers' own (models.load makes no other of tensors read: a remote-code model is
    read from its files); the teacher only where the plan also keeps both models resident and no
    memory.vram_gib budget is set (it plans no room for the teacher's bytes arriving before the student's)."""
    own = lambda m: m.quant == "none" and not m.trust_remote_code  # noqa: E731
    resident = placement == "resident" and cfg.memory.vram_gib is None
    return [role for role, read in (("student", own(cfg.student)), ("teacher", own(cfg.teacher) and resident)) if read]


def verified(store, d: Path, read, *args):
    """read(d, *args) once the store's hash of `d` checks out (joining the check started by
    Store.verify_soon), else None: a damaged dir is the in-line path's to recompute."""
    return read(d, *args) if store.verify(d) else None


def weights(d: Path, device, dtype) -> dict | None:
    """A model dir's safetensors tensors read onto `device` (safetensors' reads: the interpreter is free
    while the bytes move), for models.load to make the model of; None where a tensor is stored in
    another dtype than `dtype` (transformers would cast it, both copies on the device at once)."""
    from safetensors import safe_open

    stored = adapters.SAFETENSORS_DTYPES[dtype][0]
    if device.type == "cuda":  # (an index, as safetensors parses a device)
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt", device=str(device)) as fh:
            keys = list(fh.keys())
            if any(fh.get_slice(k).get_dtype() != stored for k in keys):
                return None
            out.update((k, fh.get_tensor(k)) for k in keys)
    return out or None


def tokenizer(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


def import_pandas() -> None:
    """pyarrow's own first check for pandas (an array from a list), so its import happens here."""
    import pyarrow as pa

    pa.array([0])
