"""The models a run keeps resident across its loop: the student with its LoRA, rollout engine and
AdamW, the teacher, the tokenizers, and where each lives (memory.placement). Loaded on first use;
the stages reach them through `Session.models` (docs/architecture.md, "Layout")."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from ..weights import adapters, ahead, lora, models
from ..weights.state import state
from ..engine import decoder, graphs, sampler, warmup
from ..engine.sampling import Sampling
from . import phases, placement, plan
from ..run import codepaths, identity
from ..rows import alignment
from ..run.config import Config
from ..errors import UserError
from ..run.store import Store, seed_of


class Resident:
    """One run's resident models. `chain` (the run's digests, over prepare's record) is set by the
    Session once prepare has run; `mark` records when a construction event first happened (train.json,
    timings.startup_s)."""

    def __init__(self, cfg: Config, store: Store, device: torch.device, dtype, planned: str | None,
                 mark: Callable[[str], None]):
        self.cfg, self.store, self.device, self.dtype, self.mark = cfg, store, device, dtype, mark
        self.chain: identity.Chain | None = None
        self._student = self._teacher = self._engine = self._tok = self._tok_t = self._maps = None
        self._policy: str | None = None  # digest of the policy whose adapter the student holds
        # memory.placement as the plan resolves it (stages/memory/plan.py); a probe may fix it up front
        self._placement: str | None = planned
        self._on_host: set[str] = set()  # placement swap: the roles waiting in host memory
        # the resident AdamW between updates: (policy digest it has stepped to, optimizer, named params)
        self.optimizer: tuple | None = None
        self._ahead = ahead.Ahead()  # reads started early (load_ahead), taken by name

    @property
    def prepared(self) -> dict:  # prepare's record: the model and tokenizer digests
        return self.chain.prepared

    # ---- the two models ----
    def student(self):
        if self._student is None:
            _ = self.placement  # decided (or refused) before any weights load
            base = models.load(self.model_dir("student"), self.cfg.student, self.device, self.dtype,
                               self._ahead.take("student_weights"))  # (None: not read ahead)
            self.mark("student_base_loaded")  # (imports, then the weights)
            if self.cfg.memory.merge_in_place:
                why = sampler.supported(base)
                if why:
                    print(f"warning: memory.merge_in_place: no fast rollout engine ({why}); nothing is merged in "
                          "place", file=sys.stderr)
                else:  # before any graph captures the weights' addresses
                    decoder.fuse_projections(base)
            if self.cfg.train.activation_checkpointing:  # only active in train() mode, i.e. the update
                models.enable_activation_checkpointing(base, preserve_rng_state=self.cfg.lora.dropout > 0)
            self._student = lora.add(base, self.cfg.lora, seed_of(self.chain.init()),
                                     kernels=codepaths.lora_kernels(self.cfg, "student", self.device.type))
            self.mark("lora_built")
            if self._ahead:  # made beside policy 0, the engine and the rollout (stages/weights/ahead.py)
                path = lambda role: self.store.path("model", self.prepared[role])  # noqa: E731
                if "teacher_weights" in self._ahead:  # (the worker has read them by now, or is reading them)
                    self._ahead.submit("teacher", lambda: ahead.verified(self.store, path("teacher"), models.load,
                                       self.cfg.teacher, self.device, self.dtype, self._ahead.take("teacher_weights")))
                self._ahead.submit("tokenizer", ahead.verified, self.store, path("student"), ahead.tokenizer)
                self._ahead.submit("pandas", ahead.import_pandas)
            if self.compiled_layers(self.cfg.student):
                print("runtime.compile_layers: the student's decoder layers compile at the first update "
                      "(about a minute on a cold compile cache)", file=sys.stderr, flush=True)
                models.compile_layers(self._student, training=True)
            self._graph_forwards(self._student, "student")
            self.mark("student_loaded")
        self._on_device("student")
        return self._student

    def teacher(self):
        if self._teacher is None and self.placement == "shared_backbone":
            self._teacher = placement.shared_teacher(self)  # the student's base, its LoRA disabled: one copy
            # a view of the student's layers: compiled as they are (lmhead then runs them eager, in eval mode)
            state(self._teacher).compiled = state(self._student).compiled
            models.mark_sampling(self._teacher, self.cfg.teacher)  # (teacher.dense_copy, not the student's)
            self._graph_forwards(self._teacher, "teacher")  # (on its view: not the student's setting)
        if self._teacher is None:
            teacher = self._ahead.take("teacher")
            if teacher is None:
                teacher = models.load(self.model_dir("teacher"), self.cfg.teacher, self.device, self.dtype)
            if self.cfg.teacher_mode == "protocol_sft":  # base + the SFT teacher adapter, merged
                dig = self.chain.teacher_adapter()
                d = self.store.get("sft", dig)
                if d is None:
                    raise UserError(f"teacher_mode=protocol_sft: the teacher adapter sft/{dig[:12]} is not in the "
                                    "store; run `opd stage train` first")
                teacher = adapters.merged(teacher, d / "adapter", self.cfg.lora)
            if self.compiled_layers(self.cfg.teacher):
                models.compile_layers(teacher, training=False)
            self._graph_forwards(teacher, "teacher")
            self._teacher = teacher
            self.mark("teacher_loaded")
        self._on_device("teacher")
        return self._teacher

    def model_dir(self, role: str) -> Path:
        """A materialised model dir, content-hashed before its weights are trusted (recomputed if damaged)."""
        d = self.store.path("model", self.prepared[role])
        if not self.store.verify(d):
            models.ensure(self.store, getattr(self.cfg, role), role, deep=True)
        return d

    def forward_length(self) -> int:
        """CUDA: the padded length of every teacher-forced forward (stages/engine/graphs.py): the run's longest prompt +
        response, so it replays one graph per batch size (longer inputs, multi-turn or evaluation's, pad further)."""
        return graphs.bucket(self.cfg.data.max_prompt_tokens + self.cfg.rollout.max_new_tokens)

    def _graph_forwards(self, model, role: str) -> None:
        st = state(model)
        st.use_graphs = role in codepaths.graphed_roles(self.cfg, self.device.type)
        st.forward_length = self.forward_length()
        st.before_capture = self.before_capture  # (graphs.hidden: as the engine's)

    def before_capture(self) -> None:
        """Before a CUDA graph capture: no other thread's device work (warm-up, a publish's sync, reads ahead)."""
        warmup.wait()
        self.store.flush()
        self._ahead.join("teacher_weights", "teacher")

    @property
    def compiled_decode(self) -> bool:
        return codepaths.compiled_decode(self.cfg, self.device.type)

    def compiled_layers(self, mcfg) -> bool:
        return codepaths.compiled_layers(self.cfg, mcfg, self.device.type)

    # ---- tokenizers ----
    def tokenizer(self):
        """The student's tokenizer (model_dir content-checks its files before anything is read)."""
        if self._tok is None:  # (a tokenizer's truth is its vocabulary's size)
            self._tok = self._ahead.take("tokenizer") or ahead.tokenizer(self.model_dir("student"))
        return self._tok

    def teacher_tokenizer(self):
        """The teacher's own tokenizer: a cross-tokenizer run's teacher reads its own tokens (stages/align.py)."""
        if self._tok_t is None:
            self._tok_t = ahead.tokenizer(self.model_dir("teacher"))
        return self._tok_t

    def alignment_maps(self) -> tuple:
        """(student token bytes, teacher token bytes, student -> teacher special ids): stages/rows/alignment.py."""
        if self._maps is None:
            s, t = self.tokenizer(), self.teacher_tokenizer()
            self._maps = (alignment.token_bytes(s), alignment.token_bytes(t), alignment.special_map(s, t))
        return self._maps

    # ---- reads ahead (stages/weights/ahead.py) ----
    def loaded_ahead(self) -> list[str] | None:  # (None: load_ahead never started)
        return list(self._ahead.taken) if self._ahead else None

    def load_ahead(self) -> None:
        """Read what the first step waits for on a worker thread (stages/weights/ahead.py): the models' weights
        from now on, and once the student's LoRA is built the teacher made of them, the tokenizer, pandas."""
        self._ahead.start()
        for role in ahead.weights_read(self.cfg, self.placement):
            self._ahead.submit(f"{role}_weights", ahead.verified, self.store, self.store.path(
                "model", self.prepared[role]), ahead.weights, self.device, self.dtype)

    # ---- where the models live (memory.placement) ----
    @property
    def placement(self) -> str:  # resident | swap | shared_backbone: memory.placement, or the plan's for auto
        if self._placement is None:
            self._placement, _ = plan.decide(self.cfg)
        return self._placement

    def activate(self, role: str) -> None:
        """The phase about to run uses `role`. Under placement swap the other role (the student with
        its moments and rollout engine; or the teacher) waits in host memory; the engine's weights and
        graphs live on the device, so it is dropped and rebuilt at the next rollout."""
        if self.placement != "swap" or self.device.type == "cpu":
            return
        other = "teacher" if role == "student" else "student"
        held = self._teacher if other == "teacher" else self._student
        if held is not None and other not in self._on_host:
            self.store.flush()  # an update still being written: its device snapshot is freed before the move
            if other == "student":
                self._engine = None
            placement.move(held, torch.device("cpu"))
            if other == "student" and self.optimizer:
                placement.move_moments(self.optimizer[1], torch.device("cpu"))
            self._on_host.add(other)
            torch.cuda.empty_cache()  # give the freed blocks back so the incoming role can use them
        self._on_device(role)

    def _on_device(self, role: str) -> None:
        """An accessor's promise: the role it returns is on the device (evicts nothing)."""
        if role in self._on_host:
            placement.move(self._teacher if role == "teacher" else self._student, self.device)
            if role == "student" and self.optimizer:
                placement.move_moments(self.optimizer[1], self.device)
            self._on_host.discard(role)

    # ---- the student's policy and its rollout engine ----
    def use_policy(self, k: int, sample: bool = False):
        """The student holding policy version k (adapter read back from the store). sample=True also
        builds its rollout engine now, so the build stays outside the caller's timed phase."""
        self.activate("student")  # rollout and update: the student's phases
        student = self.use_adapter(self.chain.policy_stage(k), self.chain.policy(k))
        if sample:
            self.engine()
        return student

    def use_adapter(self, stage: str, dig: str):
        """The student holding the adapter published by (stage, dig): init, sft or update."""
        student = self.student()
        if self._policy != dig:
            lora.load(student, self.store.path(stage, dig) / "adapter")
            self.adapter_changed(dig)
        return student

    def adapter_changed(self, dig: str) -> bool:
        """The resident student now holds policy `dig` (loaded or trained in place). True when the
        rollout engine was refreshed in place (CUDA)."""
        self._policy = dig
        if not self._engine:
            return False
        if self.device.type == "cuda":
            self._engine.refresh()  # in place: the captured graphs keep reading the same buffers
            return True
        # CPU: rebuilt at the next rollout, exactly as a resumed process builds it from the loaded
        # policy, so an uninterrupted and a resumed run share one construction path
        self._engine = None
        return False

    def premerge(self) -> bool:  # the next rollout samples the current policy: merged now (sampler.Engine)
        return bool(self._engine) and self._engine.premerge()

    def engine(self):
        """The rollout engine for the student's current policy (None: transformers fallback)."""
        if self._engine is None:
            self._engine = sampler.make(self.student(), self.cfg.rollout.cuda_graphs, self.compiled_decode,
                                        self.before_capture) or False
            if self._engine:
                self.mark("engine_built")
        return self._engine or None

    def generate(self, prompt_ids: list[list[int]], max_new: int, seed: int, greedy: bool = False,
                 min_new: int = 0):
        """Sample from the student's current policy with the fast engine (or the transformers fallback)."""
        tok = self.tokenizer()
        kw = dict(eos=tok.eos_token_id, pad=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                  seed=seed, sampling=Sampling.of(self.cfg.rollout, greedy), min_new=min_new)
        eng = self.engine()
        if eng is not None:
            return eng.generate(prompt_ids, max_new, **kw)
        return sampler.hf_generate(self.student(), prompt_ids, max_new, **kw)
