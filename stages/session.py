"""A resolved run: config, store, device, and the digest chain of its stages.

policy(0) = init digest (or the SFT cold start's, sft.steps > 0); rollout(k) reads policy(k-1); score(k) reads rollout(k); update(k) reads
policy(k-1), rollout(k), score(k) and *is* policy(k). Each digest covers only the config slice its
stage reads, which is what makes cross-run reuse work (change the objective: rollout(1) is reused;
4 -> 6 updates: updates 1-4 are reused).
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from . import memory, models, objectives
from .config import Config, slice_of
from .errors import UserError
from .store import Store, digest, link, write_json

# Stage code versions: bump when a stage's output for the same inputs would change.
# rollout 2: `reward` column; score 2: position selection (`selected` column); update 2: reads both
VERSIONS = {"tokenizer": 1, "model": 2, "prompts": 1, "init": 2, "rollout": 2, "score": 2, "update": 3,
            "evaluate": 1}


class Session:
    def __init__(self, cfg: Config):
        self.t0 = time.perf_counter()
        self.timings: dict[str, float] = {}
        self.cfg = cfg
        self.store = Store(cfg.artifacts)
        self.run_dir = Path(cfg.artifacts) / "runs" / cfg.run
        self.device = models.resolve_device(cfg.runtime.device)
        self.dtype = models.resolve_dtype(cfg.runtime.dtype, self.device)
        if cfg.runtime.threads:
            torch.set_num_threads(cfg.runtime.threads)
        self._prepared: dict | None = None
        self._digests: dict[tuple, str] = {}
        self._student = self._teacher = self._engine = None
        self._policy: str | None = None  # digest of the policy whose adapter the student holds
        self._placement: str | None = None  # memory.placement as the plan resolves it (stages/plan.py)
        self._on_host: set[str] = set()  # placement swap: the roles waiting in host memory
        self._chunk: dict[str, int] = {}  # the position chunk that fit after a CUDA OOM, per stage
        memory.limit_process(cfg.memory.vram_gib, self.device)

    # ---- resident models (loaded on first use, kept for the whole loop) ----
    def student(self):
        if self._student is None:
            from .store import seed_of

            _ = self.placement  # decided (or refused) before any weights load
            base = models.load(self.model_dir("student"), self.cfg.student, self.device, self.dtype)
            if self.cfg.train.activation_checkpointing:  # only active in train() mode, i.e. the update
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._student = models.add_lora(base, self.cfg.lora, seed_of(self.init_digest()))
        memory.ensure_on_device(self, "student")
        return self._student

    def teacher(self):
        if self._teacher is None and self.placement == "shared_backbone":
            self._teacher = memory.shared_teacher(self)  # the student's base, its LoRA disabled: one copy
        if self._teacher is None:
            self._teacher = models.load(self.model_dir("teacher"), self.cfg.teacher, self.device, self.dtype)
            if self.cfg.teacher_mode == "protocol_sft":  # base + the SFT teacher adapter, merged
                from . import sft

                self._teacher = sft.with_teacher_adapter(self, self._teacher)
        memory.ensure_on_device(self, "teacher")
        return self._teacher

    @property
    def placement(self) -> str:
        """resident | swap | shared_backbone: memory.placement, or the plan's choice for auto (weight-free)."""
        if self._placement is None:
            from . import plan

            self._placement, _ = plan.decide(self.cfg)
        return self._placement

    def activate(self, role: str) -> None:
        """The phase about to run uses `role`; under swap the other role waits in host memory."""
        memory.activate(self, role)

    def model_dir(self, role: str) -> Path:
        """A materialised model dir, content-hashed before its weights are trusted (recomputed if damaged)."""
        d = self.store.path("model", self.prepared[role])
        if not self.store.verify(d):
            from . import prepare

            prepare.model_digest(self, getattr(self.cfg, role), role, deep=True)
        return d

    def use_policy(self, k: int, sample: bool = False):
        """The student holding policy version k (adapter read back from the store). sample=True also
        builds its rollout engine now, so the build stays outside the caller's timed phase."""
        self.activate("student")  # rollout and update: the student's phases
        student = self.use_adapter(self.policy_dir(k).parent.name, self.policy_digest(k))
        if sample:
            self.engine()
        return student

    def use_adapter(self, stage: str, dig: str):
        """The student holding the adapter published by (stage, dig): init, sft or update."""
        student = self.student()
        if self._policy != dig:
            models.load_lora(student, self.store.path(stage, dig) / "adapter")
            self.adapter_changed(dig)
        return student

    def adapter_changed(self, dig: str) -> None:
        """The resident student now holds policy `dig` (loaded or trained in place)."""
        self._policy = dig
        if not self._engine:
            return
        if self.device.type == "cuda":
            self._engine.refresh()  # in place: the captured graphs keep reading the same buffers
        else:
            # CPU: rebuilt at the next rollout, exactly as a resumed process builds it from the
            # loaded policy, so an uninterrupted and a resumed run share one construction path
            self._engine = None

    def engine(self):
        """The rollout engine for the student's current policy (None: transformers fallback)."""
        if self._engine is None:
            from . import sampler

            self._engine = sampler.make(self.student(), self.cfg.rollout.cuda_graphs) or False
        return self._engine or None

    # ---- what prepare published (read back from the run view or recomputed) ----
    @property
    def prepared(self) -> dict:
        if self._prepared is None:
            from . import prepare

            self._prepared = prepare.run(self)
        return self._prepared

    @property
    def background_publish(self) -> bool:
        """Publish update outputs on a worker thread (CUDA: the host is free while the GPU samples)."""
        return self.device.type == "cuda"

    def runtime_slice(self) -> dict:
        s = {"device": self.device.type, "dtype": str(self.dtype).removeprefix("torch.")}
        if self.device.type == "cpu":  # CPU kernels may split reductions by thread count: part of the bytes
            s["threads"] = torch.get_num_threads()
        return s

    # ---- digest chain ----
    def init_digest(self) -> str:
        return digest("init", VERSIONS["init"], slice_of(self.cfg, "lora"),
                      {"student": self.prepared["student"]})

    def policy_digest(self, k: int) -> str:
        if k == 0 and self.cfg.sft.steps:  # SFT cold start: policy 0 is the trained adapter
            from . import sft

            return sft.cold_start_digest(self)
        return self.init_digest() if k == 0 else self.update_digest(k)

    def policy_dir(self, k: int) -> Path:
        stage = "update" if k else "sft" if self.cfg.sft.steps else "init"
        return self.store.path(stage, self.policy_digest(k))

    def rollout_digest(self, k: int) -> str:
        key = ("rollout", k)
        if key not in self._digests:
            s = slice_of(self.cfg, "rollout", "data.max_prompt_tokens", "data.truncation")
            s["rollout"].pop("cuda_graphs")  # graphs replay the same kernels: not part of identity
            s.update(step=k, runtime=self.runtime_slice())
            s.update(self.quant_slice("student"))
            inputs = {"policy": self.policy_digest(k - 1), "prompts": self.prepared["prompts"],
                      "student": self.prepared["student"]}
            if self.cfg.env.name:  # multi-turn episodes: keys added only here, single-turn digests unchanged
                from . import tooluse

                extra_s, extra_in = tooluse.rollout_digest_parts(self)
                s.update(extra_s)
                inputs.update(extra_in)
            self._digests[key] = digest("rollout", VERSIONS["rollout"], s, inputs)
        return self._digests[key]

    def score_digest(self, k: int) -> str:
        key = ("score", k)
        if key not in self._digests:
            ob = self.cfg.objective
            s = {"needs": sorted(objectives.needs(ob)), "topk": ob.topk, "chunk": self.cfg.train.chunk,
                 "selection": slice_of(self.cfg, "selection")["selection"],
                 "temperature": self.cfg.rollout.temperature, "runtime": self.runtime_slice()}
            if self.cfg.teacher_mode != "raw":  # keys added only then: raw-teacher digests unchanged
                s["teacher_mode"] = self.cfg.teacher_mode
            s.update(self.quant_slice("teacher"))
            self._digests[key] = digest("score", VERSIONS["score"], s, {
                "rollout": self.rollout_digest(k), **self.teacher_inputs()})
        return self._digests[key]

    def quant_slice(self, role: str) -> dict:
        """A bitsandbytes role computes different numbers: its quant joins the digests of the stages it
        runs (rollout/update: student; score: teacher). Added only then: unquantized digests unchanged."""
        m = getattr(self.cfg, role)
        if m.quant == "none":
            return {}
        return {f"{role}_quant": m.quant + ("+double_quant" if m.double_quant else "")}

    def teacher_inputs(self) -> dict:
        """What the teacher is, for digests: the base model, plus the SFT adapter under protocol_sft."""
        out = {"teacher": self.prepared["teacher"]}
        if self.cfg.teacher_mode == "protocol_sft":
            from . import sft

            out["teacher_adapter"] = sft.teacher_digest(self)
        return out

    def update_digest(self, k: int) -> str:
        key = ("update", k)
        if key not in self._digests:
            s = slice_of(self.cfg, "objective", "optim", "lora", "train.chunk", "rollout.temperature",
                         "train.activation_checkpointing")
            s.update(step=k, runtime=self.runtime_slice())
            s.update(self.quant_slice("student"))
            self._digests[key] = digest("update", VERSIONS["update"], s, {
                "policy": self.policy_digest(k - 1), "rollout": self.rollout_digest(k),
                "score": self.score_digest(k), "student": self.prepared["student"]})
        return self._digests[key]

    # ---- run view ----
    def step_dir(self, k: int) -> Path:
        return self.run_dir / f"step-{k:04d}"

    def link_step(self, k: int) -> None:
        d = self.step_dir(k)
        pol = self.policy_dir(k)
        self.store.wait(pol)  # its publish may still be running in the background
        link(pol / "adapter", d / "adapter")
        link(pol / "optimizer.safetensors", d / "optimizer.safetensors")
        state = {"policy": json.loads((pol / "state.json").read_text())}
        if k > 0:
            for name, dig in (("rollout", self.rollout_digest(k)), ("score", self.score_digest(k))):
                sd = self.store.path(name, dig)
                link(sd / f"{'scores' if name == 'score' else name}.parquet",
                     d / f"{'scores' if name == 'score' else name}.parquet")
                state[name] = json.loads((sd / "state.json").read_text())
        write_json(d / "state.json", state)


@contextmanager
def phase(device: torch.device, record: dict, tokens: int = 0):
    """Time a phase and record wall time, tokens/s and peak memory into `record`."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_rss_peak()
    t0 = time.perf_counter()
    box = {"tokens": tokens}
    yield box
    if device.type == "cuda":
        torch.cuda.synchronize()
        record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 4)
        record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 4)
    else:
        record["peak_rss_gib"] = round(_rss_peak() / 2**30, 4)
    dt = time.perf_counter() - t0
    record["wall_s"] = round(dt, 4)
    if box["tokens"]:
        record["tokens"] = int(box["tokens"])
        record["tokens_per_s"] = round(box["tokens"] / max(dt, 1e-9), 1)


def _reset_rss_peak() -> None:
    """Linux: reset the process's peak RSS (VmHWM) so the next reading is this phase's own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the reading stays the process-lifetime peak


def _rss_peak() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def require_tokenizer_match(fp_student: str, fp_teacher: str, s_name: str, t_name: str) -> None:
    if fp_student != fp_teacher:
        raise UserError(f"tokenizer mismatch: student {s_name!r} ({fp_student[:12]}) and teacher {t_name!r} "
                        f"({fp_teacher[:12]}) must share one tokenizer")
