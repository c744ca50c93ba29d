"""A resolved run, as the stages see it: its config, store and device, the resident models
(`models`, stages/memory/resident.py), the digest chain of its stages (`chain`, stages/run/identity.py
computes it) and the tables the loop hands on. docs/architecture.md describes how they fit."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .weights import models
from .engine import warmup
from .memory import hostmem, placement
from .memory.resident import Resident
from .run import identity
from .rows import tables
from .run.config import Config
from .errors import UserError
from .run.store import Store, write_json


class Session:
    """One run's resolved state, shared by the stages: `cfg`, `store`, `device`, `models` (the
    resident models: student, teacher, tokenizers, rollout engine, AdamW), `chain` (every stage's
    digest) and the in-memory hand-on of the loop's tables. Stage modules read and use these; they
    never reach into them. prepare (stages/prepare.py) sets `prepared`; the driver
    (stages/train.py `session`) runs it before any stage."""

    def __init__(self, cfg: Config, planned: str | None = None, origin: str = "overrides"):
        self.t0 = time.perf_counter()
        self.origin = origin  # "params" (a params file: `dvc repro`) or "overrides": see runview
        self.timings: dict[str, float] = {}
        self.cfg = cfg
        self.store = Store(cfg.artifacts)
        self.run_dir = Path(cfg.artifacts) / "runs" / cfg.run
        self.device = models.resolve_device(cfg.runtime.device)
        self.dtype = models.resolve_dtype(cfg.runtime.dtype, self.device)
        # always an explicit count: it also turns MKL's dynamic threading off (stages/run/reproducible.py)
        torch.set_num_threads(cfg.runtime.threads or torch.get_num_threads())
        self._prepared: dict | None = None
        self._chain: identity.Chain | None = None
        self.models = Resident(cfg, self.store, self.device, self.dtype, planned, self.mark)
        self.chunk_sizes: dict[str, int] = {}  # the position chunk that fit after a CUDA OOM, per stage
        self._tables: dict[str, tuple[str, str, object]] = {}  # stage -> (digest, file, its pa.Table): see table()
        placement.limit_process(cfg.memory.vram_gib, self.device)

    def mark(self, event: str) -> None:
        """When `event` first happened, in s since the session opened (train.json, timings.startup_s)."""
        self.timings.setdefault("startup_s", {}).setdefault(event, round(time.perf_counter() - self.t0, 4))

    # ---- what prepare published, and the digest chain made of it ----
    @property
    def prepared(self) -> dict:
        if self._prepared is None:
            raise UserError("internal: prepare has not run in this session (open it with stages.train.session)")
        return self._prepared

    @prepared.setter
    def prepared(self, record: dict) -> None:
        self._prepared = record
        self._chain = None
        self.models.chain = self.chain

    @property
    def chain(self) -> identity.Chain:
        """Every digest of the run (stages/run/identity.py): chain.rollout(k), chain.update(k), ..."""
        if self._chain is None:
            self._chain = identity.Chain(self.cfg, self.runtime_slice, self.prepared)
        return self._chain

    def runtime_slice(self) -> dict:
        return identity.runtime_slice(self.cfg, self.device.type, self.dtype, self.models.forward_length)

    def policy_dir(self, k: int) -> Path:
        """Where policy version k is published: init, the SFT cold start or update k."""
        return self.store.path(self.chain.policy_stage(k), self.chain.policy(k))

    @property
    def background_publish(self) -> bool:
        """Publish the loop's outputs (rollout, scores, update) on a worker thread (CUDA: the host is
        free while the GPU samples)."""
        return self.device.type == "cuda"

    # ---- the tables the loop hands on (rollout -> score -> update) ----
    def table(self, stage: str, dig: str, name: str, required: dict | None = None):
        """The pa.Table in `name` of the published (stage, dig): the one this process produced or read last
        for that stage, else read from the store (joining its publish if one is in flight). A step's rollout
        and scores go on to score and update from memory while their files are still being written and
        sealed on the publish thread; the file holds the same table (published files never change)."""
        held = self._tables.get(stage)
        d = self.store.path(stage, dig)
        if held is not None and held[:2] == (dig, name):
            return tables.check(held[2], d / name, required)
        self.store.wait(d)
        t = tables.read(d / name, required)
        self._tables[stage] = (dig, name, t)
        return t

    def hand_on(self, stage: str, dig: str, name: str, table, meta: dict, state: dict):
        """`table` is what (stage, dig) publishes as `name`: the loop's next stages read it from here
        (`table`). Returns the stage's writes (the Parquet file with its metadata, state.json) for the
        store to run: on the publish thread under background publishing (Store.ensure)."""
        self._tables[stage] = (dig, name, table)

        def rest(tmp: Path) -> None:
            tables.write(tmp / name, table, {"digest": dig, "tokenizer": self.prepared["tokenizer"], **meta})
            write_json(tmp / "state.json", state)

        return rest


@contextmanager
def phase(device: torch.device, record: dict, tokens: int = 0):
    """Time a phase and record wall time, tokens/s and peak memory into `record`."""
    # the current stream only: a side stream's copy (memory.merge_in_place's copy back of the student's
    # weights after a rollout, an update's snapshot) overlaps the next phase instead of ending this one
    if device.type == "cuda":
        warmup.wait()  # (its memory is not this phase's)
        torch.cuda.current_stream().synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        hostmem.reset_rss_peak()
    t0 = time.perf_counter()
    box = {"tokens": tokens}
    yield box
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()
        record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 4)
        record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 4)
    else:
        # the resident set includes memory earlier phases freed and the process keeps for reuse
        # (stages/memory/hostmem.py); how much of it is free heap now is recorded beside it
        record["peak_rss_gib"] = round(hostmem.rss_peak() / 2**30, 4)
        if (free := hostmem.free_heap_bytes()) is not None:
            record["heap_free_gib"] = round(free / 2**30, 4)
    dt = time.perf_counter() - t0
    record["wall_s"] = round(dt, 4)
    if box["tokens"]:
        record["tokens"] = int(box["tokens"])
        record["tokens_per_s"] = round(box["tokens"] / max(dt, 1e-9), 1)

