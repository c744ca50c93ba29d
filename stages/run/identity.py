"""Stage identity, declared once: every store stage's name, code version, the config keys it reads
and the inputs its digest names; the digests are computed here from that declaration.

A stage's digest is `store.digest(name, version, config slice, inputs)` (docs/architecture.md, "the
digest rule"). The slice is built through `Reads`, which lets a stage see only the keys it declares:
reading an undeclared key is an error, so the declaration cannot fall behind the code. `dvc.yaml`'s
params and deps are generated from the same declaration (`opd dvc-yaml`, stages/tools/dvcyaml.py).

Nothing here loads a model or needs a Session: `Chain` turns (config, runtime slice, prepare's
record) into every digest of a run. Bump a stage's version when its output for the same inputs
would change; its digest (and every digest downstream) changes with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import objectives
from . import reproducible
from .codepaths import compiled_decode, compiled_layers, graphed_roles, lora_kernels
from .config import Config, slice_of
from .store import digest


@dataclass(frozen=True)
class Stage:
    name: str  # its directory in the store: artifacts/store/<name>/<digest>
    version: int  # code version: bump when the same inputs would give other bytes
    reads: tuple[str, ...]  # config keys (dotted; a group name covers the group) its identity reads
    inputs: tuple[str, ...]  # what its digest names besides config: upstream digests, content hashes
    dvc: str | None  # the DVC stage that runs it (None: a tool's cache, not a pipeline stage)


MODEL_KEYS = ("name", "revision", "init", "keep_layers", "trust_remote_code", "tokenizer")
# device, dtype, (CPU) MKL's mode and, only where it changes bytes, the thread count: runtime_slice below
RUNTIME = ("runtime",)
# On CUDA, what the rollout engine replays from captured graphs (the value of rollout.cuda_graphs in
# the CUDA digests): the prefill and the decode step. It names what is captured because cuBLAS may
# choose another algorithm under capture, so capturing more can change the bytes
ENGINE_GRAPHS = "prefill+decode"

STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("tokenizer", 1, (), ("gguf",), "prepare"),
    Stage("model", 2, tuple(f"{r}.{k}" for r in ("student", "teacher") for k in MODEL_KEYS), ("parent", "files"),
          "prepare"),
    # data.path / data.eval_path are read only as "set or not": the files' content hashes (rows,
    # eval_rows) are the inputs, so the same file at another path is the same stage (`_data`)
    Stage("prepared", 1, ("data", "env", "objective.topk", "objective.cross_tokenizer"),
          ("student", "teacher", "rows", "eval_rows"), "prepare"),
    Stage("prompts", 1, ("data",), ("tokenizer", "rows", "eval_rows"), "prepare"),
    Stage("tasks", 1, ("env.name", "env.split", "env.num_train", "env.num_test", "env.seed"), ("tokenizer",),
          "prepare"),
    Stage("init", 2, ("lora",), ("student",), "train"),
    Stage("sft", 1, ("sft", "optim", "lora", "train.chunk") + RUNTIME, ("parent", "model", "tasks"), "train"),
    # rollout 2: `reward` column. rollout.sampler=teacher: the teacher samples (its quant, no policy)
    Stage("rollout", 2, ("rollout", "data.max_prompt_tokens", "data.truncation", *(f"{r}.{q}" for r in (
          "student", "teacher") for q in ("quant", "double_quant", "dense_copy")), "env", "train.seed") + RUNTIME,
          ("policy", "prompts", "student", "tasks", "teacher", "teacher_adapter"), "train"),
    # score 2: position selection (`selected` column). Of the objective it reads only what the teacher
    # must record (objectives.needs: the name) and how many top-k entries; the rest is the update's
    # align: cross-tokenizer runs only (objective.cross_tokenizer=spans); torch-free and device-free,
    # so no runtime: the student's responses re-tokenized by the teacher, aligned on byte spans
    Stage("align", 1, ("objective.cross_tokenizer", "data.max_prompt_tokens", "data.truncation", "data.prompt_key"),
          ("rollout", "prompts", "student", "teacher"), "train"),
    Stage("score", 2, ("objective.name", "objective.topk", "objective.cross_tokenizer", "train.chunk", "selection",
                       "rollout.temperature", "teacher_mode", "teacher.quant", "teacher.double_quant") + RUNTIME,
          ("rollout", "teacher", "teacher_adapter", "align"), "train"),
    # update 3: reads both (`reward`, `selected`)
    Stage("update", 3, ("objective", "optim", "lora", "train.chunk", "rollout.temperature",
                        "train.activation_checkpointing", "student.quant", "student.double_quant") + RUNTIME,
          ("policy", "rollout", "score", "student", "align"), "train"),
    # evaluate 2: eval.json adds the answers (non-blank share, distinct bigrams) and the side-by-side samples;
    # 3: task accuracy per role and the flipped prompts (eval.json), score and checker (samples.parquet)
    Stage("evaluate", 3, ("eval", "train.updates", "rollout.cuda_graphs", "objective.cross_tokenizer",
                          "student.dense_copy", "teacher.dense_copy") + RUNTIME,
          ("initial", "final", "policies", "prompts", "teacher", "teacher_adapter", "student"), "evaluate"),
    Stage("tooleval", 1, ("env.max_turns", "env.max_tokens_per_turn", "rollout.cuda_graphs",
                          "student.dense_copy") + RUNTIME,
          ("policy", "policy_stage", "tasks", "student"), None),
    # probe 2: peaks exclude what the process held on the device before the probe loaded its models;
    # 3: the score and update forwards replay CUDA graphs (runtime.cuda_graphs); 4: NF4 roles' too
    Stage("probe", 4, ("lora.r", "lora.target_modules", "objective.name", "objective.topk", "memory.vram_gib",
                       "runtime.cuda_graphs"),
          (), None),
)}
# the training loop itself (stages/train.py) reads how many updates to run
DRIVER_READS = {"train": ("train.updates",)}


class Reads:
    """The config as a stage may see it: declared keys (and everything under them) read through;
    any other key is an error naming the stage, so a new read must be declared (and reach dvc.yaml)."""

    def __init__(self, cfg: Any, stage: str, keys: tuple[str, ...], prefix: str = ""):
        self._cfg, self._stage, self._keys, self._prefix = cfg, stage, keys, prefix

    def __getattr__(self, name: str) -> Any:
        key = self._prefix + name
        if any(key == k or key.startswith(k + ".") for k in self._keys):
            return getattr(self._cfg, name)
        if any(k.startswith(key + ".") for k in self._keys):
            return Reads(getattr(self._cfg, name), self._stage, self._keys, key + ".")
        raise KeyError(f"stage '{self._stage}' reads config key '{key}' without declaring it (stages/run/identity.py)")


def reads(cfg: Config, stage: str) -> Any:
    return Reads(cfg, stage, STAGES[stage].reads)


def make(stage: str, cfg_slice: dict, inputs: dict[str, Any]) -> str:
    """The digest of `stage` from its config slice and inputs (only declared inputs are accepted)."""
    _declared(stage, inputs)
    return digest(stage, STAGES[stage].version, cfg_slice, inputs)


# ---- the stages prepare publishes ----

def tokenizer(gguf_hash: str) -> str:
    return make("tokenizer", {"source": "embedded"}, {"gguf": gguf_hash})


def model(ident: dict) -> str:
    """A model materialised from its source; `ident` is models.identity_of (settings + file hashes)."""
    return digest("model", STAGES["model"].version, ident, {})


def pruned_model(keep_layers: int, parent: str) -> str:
    """A student pruned to `keep_layers` from its materialised parent."""
    return make("model", {"keep_layers": keep_layers}, {"parent": parent})


def prepared(cfg: Config, files: dict[str, str], student: str, teacher: str) -> str:
    """The checks and records of prepare; `files`: content hashes of the prompt rows (rows, eval_rows)."""
    c = reads(cfg, "prepared")
    _declared("prepared", files)
    s = {**slice_of(c, "env", "objective.topk"), "data": _data(c), **files}
    if c.objective.cross_tokenizer != "off":  # its checks and record differ; the key only then (digests unchanged)
        s["objective.cross_tokenizer"] = c.objective.cross_tokenizer
    return make("prepared", s, {"student": student, "teacher": teacher})


def prompts(cfg: Config, tokenizer_fp: str, files: dict[str, str]) -> str:
    c = reads(cfg, "prompts")
    _declared("prompts", files)
    return make("prompts", {"data": _data(c), "tokenizer": tokenizer_fp, **files}, {})


# Where a prompt file lives is not what it holds: a file's identity is its content hash (`rows`, `eval_rows`);
# its path enters a digest only as this marker. A generator's rows (path null) keep their digests.
FROM_FILE = {"path": "file: content hash in `rows`", "eval_path": "file: content hash in `eval_rows`"}


def _data(c: Any) -> dict:
    d = slice_of(c, "data")["data"]
    return {k: (FROM_FILE[k] if k in FROM_FILE and v is not None else v) for k, v in d.items()}


def tasks(cfg: Config, part: str, tokenizer_fp: str) -> str:
    e = reads(cfg, "tasks").env
    n = e.num_train if part == "train" else e.num_test
    return make("tasks", {"env": e.name, "split": e.split, "n": n, "seed": e.seed, "part": part,
                          "tokenizer": tokenizer_fp}, {})


def _declared(stage: str, names) -> None:
    if extra := set(names) - set(STAGES[stage].inputs):
        raise KeyError(f"stage '{stage}': undeclared inputs {sorted(extra)} (stages/run/identity.py)")


def quantized_sampling(c: Any, *roles: str) -> dict:
    """An NF4 role with dense_copy=false samples through transformers over its 4-bit weights, not the engine's
    dense copy: a key for each such role of evaluate and tooleval (rollout: its `engine` key), only then."""
    return {f"{r}_sampling": "nf4-transformers" for r in roles if not getattr(c, r).dense_copy}  # (validation: nf4)


def quant(c: Any, role: str) -> dict:
    """A bitsandbytes role computes different numbers: its quant joins the digests of the stages it
    runs (rollout/update: student; score: teacher). Added only then: unquantized digests unchanged."""
    m = getattr(c, role)
    if m.quant == "none":
        return {}
    return {f"{role}_quant": m.quant + ("+double_quant" if m.double_quant else "")}


class Chain:
    """Every digest of one run, from the config, the runtime slice and prepare's record.

    policy(0) = init (or the SFT cold start, sft.steps > 0); rollout(k) reads policy(k-1); score(k)
    reads rollout(k); update(k) reads policy(k-1), rollout(k), score(k) and *is* policy(k). Each
    digest covers only the config its stage reads, which is what makes cross-run reuse work (change
    the objective: rollout(1) is reused; 4 -> 6 updates: updates 1-4 are reused)."""

    def __init__(self, cfg: Config, runtime: Callable[[], dict], prepared: dict):
        self.cfg, self.runtime, self.prepared = cfg, runtime, prepared
        self._memo: dict[tuple, str] = {}

    def init(self) -> str:
        return make("init", slice_of(reads(self.cfg, "init"), "lora"), {"student": self.prepared["student"]})

    def sft(self, role: str, parent: str | None, start: int, steps: int) -> str:
        c = reads(self.cfg, "sft")
        optim = slice_of(c, "optim")["optim"]
        for key in ("lr", "warmup_updates"):  # SFT has its own lr and no warmup
            optim.pop(key)
        s = {"role": role, "start": start, "steps": steps, "batch_size": c.sft.batch_size, "lr": c.sft.lr,
             "seed": c.sft.seed if role == "student" else c.sft.teacher_seed, "optim": optim,
             "lora": slice_of(c, "lora")["lora"], "chunk": c.train.chunk, "runtime": self.runtime()}
        return make("sft", s, {"parent": parent, "model": self.prepared[role], "tasks": self.prepared["tasks_train"]})

    def cold_start(self) -> str:
        """Policy 0 when sft.steps > 0: the fresh LoRA trained on verified traces."""
        return self.sft("student", self.init(), 0, reads(self.cfg, "sft").sft.steps)

    def continued(self, steps: int) -> str:
        """`steps` more SFT steps from policy 0 (the benchmark's sft-continued arm)."""
        return self.sft("student", self.policy(0), reads(self.cfg, "sft").sft.steps, steps)

    def teacher_adapter(self) -> str:
        """The teacher's SFT adapter that teacher_mode=protocol_sft reads."""
        return self.sft("teacher", None, 0, reads(self.cfg, "sft").sft.teacher_steps)

    def policy(self, k: int) -> str:
        if k == 0 and reads(self.cfg, "sft").sft.steps:
            return self.cold_start()
        return self.init() if k == 0 else self.update(k)

    def policy_stage(self, k: int) -> str:
        """The store stage that publishes policy k: update, or (k = 0) sft or init."""
        return "update" if k else "sft" if reads(self.cfg, "sft").sft.steps else "init"

    def teacher_inputs(self) -> dict:
        """What the teacher is, for digests: the base model, plus the SFT adapter under protocol_sft."""
        out = {"teacher": self.prepared["teacher"]}
        if reads(self.cfg, "score").teacher_mode == "protocol_sft":
            out["teacher_adapter"] = self.teacher_adapter()
        return out

    def rollout(self, k: int) -> str:
        key = ("rollout", k)
        if key not in self._memo:
            c = reads(self.cfg, "rollout")
            s = slice_of(c, "rollout", "data.max_prompt_tokens", "data.truncation")
            g = self._engine_graphs(c)
            if g is None:
                s["rollout"].pop("cuda_graphs")
            else:
                s["rollout"]["cuda_graphs"] = g
            s.update(step=k, runtime=self.runtime())
            # who samples: the student at policy k-1, or (rollout.sampler=teacher, the off-policy control)
            # the teacher, which no policy reaches: its identity replaces the policy's. The key only then
            role = s["rollout"].pop("sampler")
            s.update(quant(c, role))
            if getattr(c, role).quant == "nf4":  # the engine's dense copy, or transformers (dense_copy=false)
                s["engine"] = "nf4-dequantized" if getattr(c, role).dense_copy else "nf4-transformers"
            inputs = {"prompts": self.prepared["prompts"], "student": self.prepared["student"],
                      **({"policy": self.policy(k - 1)} if role == "student" else self.teacher_inputs())}
            if role != "student":
                s["sampler"] = role
            if c.env.name:  # multi-turn episodes: keys added only here, single-turn digests unchanged
                e = slice_of(c, "env")["env"]
                e.pop("num_test")  # held-out tasks only
                s.update({"env": e, "train.seed": c.train.seed, "multi_turn": STAGES["tasks"].version})
                inputs["tasks"] = self.prepared["tasks_train"]
            self._memo[key] = make("rollout", s, inputs)
        return self._memo[key]

    def align(self, k: int) -> str:
        """rollout(k)'s responses in the teacher's tokens, aligned on byte spans (cross-tokenizer runs)."""
        key = ("align", k)
        if key not in self._memo:
            c = reads(self.cfg, "align")
            s = slice_of(c, "objective.cross_tokenizer", "data.max_prompt_tokens", "data.truncation",
                         "data.prompt_key")
            self._memo[key] = make("align", s, {"rollout": self.rollout(k), "prompts": self.prepared["prompts"],
                                                "student": self.prepared["student"],
                                                "teacher": self.prepared["teacher"]})
        return self._memo[key]

    def score(self, k: int) -> str:
        key = ("score", k)
        if key not in self._memo:
            c = reads(self.cfg, "score")
            ob = c.objective
            s = {"needs": sorted(objectives.needs(ob)), "topk": ob.topk, "chunk": c.train.chunk,
                 "selection": slice_of(c, "selection")["selection"], "temperature": c.rollout.temperature,
                 "runtime": self.runtime()}
            if c.teacher_mode != "raw":  # keys added only then: raw-teacher digests unchanged
                s["teacher_mode"] = c.teacher_mode
            s.update(quant(c, "teacher"))
            inputs = {"rollout": self.rollout(k), **self.teacher_inputs()}
            if ob.cross_tokenizer != "off":  # the teacher reads the aligned tokens (same rule: others unchanged)
                s["cross_tokenizer"] = ob.cross_tokenizer
                inputs["align"] = self.align(k)
            self._memo[key] = make("score", s, inputs)
        return self._memo[key]

    def update(self, k: int) -> str:
        key = ("update", k)
        if key not in self._memo:
            c = reads(self.cfg, "update")
            s = slice_of(c, "objective", "optim", "lora", "train.chunk", "rollout.temperature",
                         "train.activation_checkpointing")
            s.update(step=k, runtime=self.runtime())
            s.update(quant(c, "student"))
            inputs = {"policy": self.policy(k - 1), "rollout": self.rollout(k), "score": self.score(k),
                      "student": self.prepared["student"]}
            if s["objective"].pop("cross_tokenizer") != "off":  # key and input only then: other digests unchanged
                s["objective"]["cross_tokenizer"] = c.objective.cross_tokenizer
                inputs["align"] = self.align(k)
            self._memo[key] = make("update", s, inputs)
        return self._memo[key]

    def _engine_graphs(self, c):
        """rollout.cuda_graphs as the identities of what samples with the rollout engine (rollout,
        evaluate, tooleval) hold it: on CUDA what the engine replays from captured graphs (their
        kernels may round otherwise than eager), ENGINE_GRAPHS or False; None on CPU, which never
        captures one (its digests stay as they were)."""
        if self.runtime().get("device") != "cuda":
            return None
        return ENGINE_GRAPHS if c.rollout.cuda_graphs else False

    def _with_engine_graphs(self, s: dict, c) -> dict:
        g = self._engine_graphs(c)
        return s if g is None else {**s, "rollout.cuda_graphs": g}

    def evaluate(self) -> str:
        c = reads(self.cfg, "evaluate")
        s = slice_of(c, "eval")
        s["runtime"] = self.runtime()
        s = self._with_engine_graphs(s, c)  # it samples greedy answers with the rollout engine
        s.update(quantized_sampling(c, "student", "teacher"))
        if c.objective.cross_tokenizer != "off":  # measured on aligned spans; the key only then
            s["objective.cross_tokenizer"] = c.objective.cross_tokenizer
        K = c.train.updates  # eval.every > 0: also the policies between 0 and K, and the key
        inputs = {"initial": self.policy(0), "final": self.policy(K), "prompts": self.prepared["prompts"],
                  **self.teacher_inputs(), "student": self.prepared["student"]}
        if s["eval"]["every"]:  # (only then: the digests of runs without it unchanged)
            inputs["policies"] = {str(k): self.policy(k) for k in c.eval.policies(K)[1:-1]}
        else:
            del s["eval"]["every"]
        return make("evaluate", s, inputs)

    def tooleval(self, stage: str, policy: str) -> str:
        """Greedy held-out episodes of the student adapter published by (stage, policy)."""
        c = reads(self.cfg, "tooleval")
        s = self._with_engine_graphs({"max_turns": c.env.max_turns, "max_tokens_per_turn": c.env.max_tokens_per_turn,
                                      "runtime": self.runtime()}, c)
        s.update(quantized_sampling(c, "student"))
        return make("tooleval", s, {"policy": policy, "policy_stage": stage, "tasks": self.prepared["tasks_test"],
                                    "student": self.prepared["student"]})


def runtime_slice(cfg, device_type: str, dtype, forward_length: Callable[[], int]) -> dict:
    """The part of every digest that the machine decides: what kernels, layouts and settings compute the bytes
    on this device (each key only where it changes them, so that digests made without it stay what they
    were). Each choice is codepaths' (the same functions decide what the run builds)."""
    s = {"device": device_type, "dtype": str(dtype).removeprefix("torch.")}
    if compiled_decode(cfg, device_type):  # the fused decode kernels (stages/engine/kernels.py), attention
        s["decode"] = "project+rope_attention-blocks"  # at any batch size reading the cache in blocks
    if device_type == "cuda":
        s["draw"] = "kernel"  # plain sampling's draw as stages/engine/draw.py's kernels
        # teacher-forced forwards in the padded layout (stages/engine/graphs.py), replayed from graphs for the
        # graphed roles (cuBLAS may choose another algorithm under capture: graph and eager may differ)
        s["forwards"] = f"padded-to-{forward_length()}"
        s["norms"] = "fused"  # transformers' RMSNorms as torch's fused kernel (stages/weights/norms.py)
        if graphed := graphed_roles(cfg, device_type):
            s["forward_graphs"] = sorted(graphed, reverse=True)  # ["student", "teacher"]
        if cfg.rollout.cuda_graphs and cfg.student.quant == "nf4" and cfg.student.dense_copy:
            s["nf4_merge"] = "graph"  # the engine's LoRA merge into its NF4 dense copy replays a captured graph
    if lora_kernels(cfg, "student", device_type) or cfg.teacher_mode == "protocol_sft" and lora_kernels(
            cfg, "teacher", device_type):
        s["lora"] = "kernels"  # a trained LoRA's branch as stages/weights/lora_kernels.py computes it
    if compiled_layers(cfg, cfg.student, device_type) or compiled_layers(cfg, cfg.teacher, device_type):
        s["layers"] = "compiled"  # fused kernels round differently (which: by the quant keys, in the digests)
    if device_type == "cpu":
        # MKL's reproducibility mode decides the CPU bytes, and the thread count too unless it is strict
        m = reproducible.check()
        if m != "none":  # (no key without MKL)
            s["mkl_cbwr"] = m
        if not reproducible.thread_independent(m):
            s["threads"] = torch.get_num_threads()
    return s
