"""Identity completeness (stages/run/identity.py, docs/architecture.md "the digest rule"): every leaf
config key a stage declares moves the config slice that stage's digest hashes, and a slice moves only
with a key its stage declares. Each leaf key is set alone to each other value that passes config
validation, on three runs that between them take every branch the digests have. Digests only: no
model is loaded, nothing is written."""
from __future__ import annotations

import copy
import dataclasses
import typing

import pytest

from stages import envs, objectives
from stages.run import identity, validation
from stages.weights import models
from stages.run.config import ROOT, compose
from stages.errors import UserError
from stages.tools import probe
from support import TINY

# "tool": multi-turn with both SFT adapters, both models NF4 and a CUDA runtime slice (where
# rollout.cuda_graphs is part of the identity); "plain": single-turn, unquantized, CPU, with the
# objective and selection mode whose keys "tool" would refuse (divergence, budget); "jsonnav": an
# environment whose split another one shares (env.name changes alone: calculator's splits are its own)
TOOL = ["sft.steps=2", "sft.teacher_steps=2", "teacher_mode=protocol_sft"]
BASES = {
    "tool": (["env.name=calculator", *TOOL, "student.quant=nf4", "teacher.quant=nf4", "selection.mode=hybrid",
              "selection.ratio=0.5"], {"device": "cuda", "dtype": "bfloat16", "draw": "kernel"}),
    "plain": (["objective.name=bucketed_topk_tail", "selection.mode=uniform_budget", "selection.budget=4"],
              {"device": "cpu", "dtype": "float32", "threads": 1}),
    "jsonnav": (["env.name=jsonnav", "env.split=default", *TOOL], {"device": "cpu", "dtype": "float32"}),
    # a cross-tokenizer run: the align stage joins the loop
    "cross": (["objective.name=k1", "objective.use_policy_gradient=true", "objective.cross_tokenizer=spans"],
              {"device": "cpu", "dtype": "float32"}),
    # the off-policy control: the teacher samples (an NF4 teacher, so that its quant keys reach the rollout)
    "offpolicy": (["rollout.sampler=teacher", "objective.name=nll", "teacher.quant=nf4"],
                  {"device": "cpu", "dtype": "float32"}),
}
TOKENIZER_FP, ROWS = "f" * 32, {"rows": "e" * 32}  # file contents, not config: held fixed
# The memory plan the probe's identity is built from (shapes, workload, placement): held fixed, an input
PLAN = {"models": {"student": {"layers": 2}}, "workload": {"sequences": 4}, "placement": {"chosen": "resident"},
        "dtype": "bfloat16"}
RUNTIME_STAGES = tuple(s.name for s in identity.STAGES.values() if "runtime" in s.reads)

# Declared keys that move no slice of their stage here, and why. Keep this short: each entry is a
# key the test cannot vouch for.
EXEMPT = {
    ("model", "student.init"): "no valid change alone: random goes with an arch: model, pretrained with any other",
    ("model", "teacher.init"): "(as student.init)",
    ("model", "student.revision"): "only a Hugging Face id reads it (which snapshot's files are hashed, and the "
                                   "hashes are the identity); an arch: model has none",
    ("model", "teacher.revision"): "(as student.revision)",
    **{(s, "runtime"): "reaches the digest as Session.runtime_slice, which the test gives as a value and perturbs "
                       "as one (test_the_runtime_slice_moves_the_stages_that_declare_it)" for s in RUNTIME_STAGES},
    ("rollout", "env.num_test"): "held-out tasks only; rollout declares env whole so that a new env key joins it",
    ("sft", "optim.lr"): "SFT has its own lr (sft.lr); it declares optim whole so that a new optimizer key joins it",
    ("sft", "optim.warmup_updates"): "SFT has no warmup (as optim.lr)",
    ("evaluate", "train.updates"): "chooses which policy is the final one, an input: in no slice",
    ("align", "objective.cross_tokenizer"): "its one other value (off) removes the stage from the run",
}


def covers(stage: str, key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in identity.STAGES[stage].reads)


def exempt(stage: str, key: str) -> bool:
    return (stage, key) in EXEMPT or (stage, key.split(".")[0]) in EXEMPT


def leaves(obj, prefix: str = ""):
    """(dotted key, value, type) of every leaf of the config."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from leaves(v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", v, hints[f.name]


def alternatives(key: str, value, hint, tokdir: str) -> list:
    """Other values of `key`; the sweep keeps those that pass validation."""
    pools = {"objective.name": sorted(objectives.REGISTRY), "env.name": [None, *sorted(envs.REGISTRY)],
             "env.split": ["easy", "medium", "default"], "data.generator": ["topics", "arith", "arith_words"],
             **{f"{r}.name": sorted(f"arch:{p.stem}" for p in (ROOT / "conf" / "arch").glob("*.json"))
                for r in ("student", "teacher")},
             **{f"{r}.tokenizer": ["embedded", tokdir] for r in ("student", "teacher")}}
    optional = typing.get_origin(hint) is typing.Union  # Optional[X]
    t = typing.get_args(hint)[0] if optional else hint
    if key in pools or key in validation.CHOICES:
        pool = list(pools.get(key) or validation.CHOICES[key])
    elif t is bool:
        pool = [not value]
    elif t is int:
        pool = [value + 1]
    elif t is float:
        pool = [value * 2, value / 2] if value else [0.5]  # (a bound such as top_p <= 1 refuses one of them)
    elif t is str:
        pool = [f"{value}-other" if value else "other"]
    else:  # list[str]
        pool = [value[:-1], value + ["<x>"]]
    return [v for v in pool + [None] * optional if v != value]


def perturbed(cfg, key: str, value):
    c = copy.deepcopy(cfg)
    *path, leaf = key.split(".")
    setattr(validation.get(c, ".".join(path)) if path else c, leaf, value)
    return validation.validate(c, "perturbed")


def digests(cfg, runtime: dict) -> dict[str, tuple[str, dict]]:
    """{stage instance: (digest, the config slice it hashed)} of a run of `cfg`, computed as prepare and
    the training loop compute them (an arch: model has no parent: models.ensure's identity is identity_of's)."""
    hashed: dict[str, dict] = {}
    real = identity.digest

    def recording(stage, version, cfg_slice, inputs):
        d = real(stage, version, cfg_slice, inputs)
        hashed[d] = copy.deepcopy(cfg_slice)
        return d

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(identity, "digest", recording)
        out = {"tokenizer": identity.tokenizer("0" * 32)}
        m = identity.reads(cfg, "model")  # identity_of sees only what the model stage declares
        for role in ("student", "teacher"):
            out[f"model.{role}"] = identity.model(models.identity_of(getattr(m, role), role))
        prep = {"student": out["model.student"], "teacher": out["model.teacher"],
                "prompts": identity.prompts(cfg, TOKENIZER_FP, ROWS)}
        out["prompts"] = prep["prompts"]
        out["prepared"] = identity.prepared(cfg, ROWS, prep["student"], prep["teacher"])
        if cfg.env.name:
            for part in ("train", "test"):
                out[f"tasks.{part}"] = prep[f"tasks_{part}"] = identity.tasks(cfg, part, TOKENIZER_FP)
        ch = identity.Chain(cfg, lambda: dict(runtime), prep)
        out["init"] = ch.init()
        if cfg.sft.steps:
            out["sft.student"] = ch.cold_start()
        if cfg.teacher_mode == "protocol_sft":
            out["sft.teacher"] = ch.teacher_adapter()
        for k in (1, 2):
            out[f"rollout.{k}"], out[f"score.{k}"], out[f"update.{k}"] = ch.rollout(k), ch.score(k), ch.update(k)
            if cfg.objective.cross_tokenizer != "off":
                out[f"align.{k}"] = ch.align(k)
        out["evaluate"] = ch.evaluate()
        if cfg.env.name:
            out["tooleval"] = ch.tooleval(ch.policy_stage(2), ch.policy(2))
        out["probe"] = identity.make("probe", probe.identity(identity.reads(cfg, "probe"), PLAN), {})
    return {n: (d, hashed[d]) for n, d in out.items()}


def compare(before: dict, after: dict, key: str) -> tuple[set[str], list[str]]:
    """(stages with an instance whose config slice moved; instances whose slice moved although their
    stage does not declare `key`). The slice, not the digest: a digest also moves with its inputs,
    which would credit a stage with what an upstream stage read."""
    own, wrong = set(), []
    for n in before.keys() & after.keys():
        if before[n][1] != after[n][1]:
            own.add(n.split(".")[0])
            if not covers(n.split(".")[0], key):
                wrong.append(f"{n}'s slice moved with {key}, which its stage does not declare")
    return own, wrong


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every leaf key set alone to each valid alternative, on each base run."""
    tokdir = tmp_path_factory.mktemp("tokenizer")
    (tokdir / "tokenizer_config.json").write_text("{}")
    keys = [k for k, _, _ in leaves(compose([], ROOT / "conf"))]
    # (stage, leaf key it declares) -> moved on some valid alternative
    moved = {(s, k): False for k in keys for s in identity.STAGES if covers(s, k)}
    wrong, undeclared = [], {}
    for base_name, (overrides, runtime) in BASES.items():
        cfg = compose(TINY + overrides, ROOT / "conf")
        before = digests(cfg, runtime)
        for key, value, hint in leaves(cfg):
            for alt in alternatives(key, value, hint, str(tokdir)):
                try:
                    after = digests(perturbed(cfg, key, alt), runtime)
                except UserError:  # not a valid value here
                    continue
                stages, bad = compare(before, after, key)
                wrong += [f"[{base_name}] {b} (={alt!r})" for b in bad]
                for s in stages:
                    if (s, key) in moved:
                        moved[s, key] = True
                if not any(covers(s, key) for s in identity.STAGES):  # nothing may move, appear or go
                    undeclared.setdefault(key, set()).update(
                        n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    return moved, wrong, undeclared


def test_a_slice_moves_only_with_a_key_its_stage_declares(sweep):
    _, wrong, _ = sweep
    assert wrong == []


def test_every_declared_key_moves_its_stage(sweep):
    """(A key with no valid alternative in any base run moves nothing: it fails here too.)"""
    moved, _, _ = sweep
    assert sorted(f"{s}: {k}" for (s, k), m in moved.items() if not m and not exempt(s, k)) == []


def test_exempt_keys_really_move_nothing_of_their_stage(sweep):
    """An exemption that no longer holds (the key now moves its stage) is removed, not kept."""
    moved, _, _ = sweep
    assert sorted(f"{s}: {k}" for (s, k), m in moved.items() if m and exempt(s, k)) == []


def test_a_key_no_stage_declares_moves_no_digest(sweep):
    _, _, undeclared = sweep
    assert {"memory.placement", "memory.margin", "run", "artifacts"} <= undeclared.keys()  # (the sweep reached them)
    assert {k: n for k, n in undeclared.items() if n} == {}


@pytest.mark.parametrize("base", BASES)
def test_the_runtime_slice_moves_the_stages_that_declare_it(base):
    overrides, runtime = BASES[base]
    cfg = compose(TINY + overrides, ROOT / "conf")
    before, after = digests(cfg, runtime), digests(cfg, {**runtime, "dtype": "float64"})
    stages, wrong = compare(before, after, "runtime")
    assert wrong == []
    assert stages == {s for s in RUNTIME_STAGES if any(n.split(".")[0] == s for n in before)}
