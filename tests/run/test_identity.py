"""Stage identity declared once (stages/run/identity.py): digests pinned, reads enforced, dvc.yaml generated
from the declarations. (tests/integration/test_dvc_params.py checks the generated dvc.yaml with real dvc.)"""
from __future__ import annotations

import ast
import dataclasses

import pytest
import torch

from stages.run import codepaths, config, identity
from stages.run.config import ROOT
from stages.tools import dvcyaml
from support import TINY

PREP = {"student": "5" * 32, "teacher": "7" * 32, "prompts": "a" * 32, "tasks_train": "b" * 32,
        "tasks_test": "c" * 32}
RUNTIME = {"device": "cpu", "dtype": "float32", "threads": 1}
BASE = [o for o in TINY if not o.startswith(("train.updates", "data.", "rollout.", "eval.", "student.tokenizer",
                                              "teacher.tokenizer"))] + ["train.updates=2"]
ENV = ["env.name=calculator", "sft.steps=2", "sft.teacher_steps=2", "teacher_mode=protocol_sft", "student.quant=nf4"]

# Digests of a fixed config and prepare record. A change here changes every stored result's address:
# it must be a deliberate identity change (a version bump, a new key), never a side effect of a refactor.
# ("env" holds an NF4 student: its rollouts moved to the engine's dense copy, `engine` in their slice.)
# evaluate is at version 3 (task accuracy and flipped prompts join its record): only its digests moved,
# as nothing else here reads it (the report is no store stage)
PINNED = {
    "plain": {"policy0": "e8a4fa1612a21b72682aad1b6e13887c", "rollout2": "cf04b8556e15beec20d215e32ddebb8d",
              "score2": "cfe0f693d9398b56889ea405d79e64f0", "update2": "e3211fc7e577b6e44adb44fb867ad3d8",
              "evaluate": "a0e3c59d4a8482b12fd13567bb8531d8", "prompts": "b791100a50953b5ceda608ff9593e2ec",
              "prepared": "14dfc67f5427a8a485b289dbdfd62eb0"},
    "env": {"policy0": "f68ebb180db658195f45721a5d3a5595", "rollout2": "fe446abae07723efec9225bd854a42f6",
            "score2": "152dc1e4f19c740fbee4d171a778317d", "update2": "5a6701ca55ecca67b12b02c80e3c5bff",
            "evaluate": "9ef25d04c4f1c63d2d0184f46ebd2157", "tooleval": "fc1c2c0e334290d74e9e3bed659c700d",
            "tasks_test": "526c6c7b0224df8976d2c9683838ac2d"},
}


def digests(extra: list[str], runtime: dict = RUNTIME) -> dict:
    cfg = config.compose(BASE + extra, ROOT / "conf")
    ch = identity.Chain(cfg, lambda: dict(runtime), PREP)
    out = {"policy0": ch.policy(0), "rollout2": ch.rollout(2), "score2": ch.score(2), "update2": ch.update(2),
           "evaluate": ch.evaluate()}
    if cfg.env.name:
        out["tooleval"] = ch.tooleval("update", ch.policy(2))
        out["tasks_test"] = identity.tasks(cfg, "test", "f" * 32)
    else:
        out["prompts"] = identity.prompts(cfg, "f" * 32, {"rows": "e" * 32})
        out["prepared"] = identity.prepared(cfg, {"rows": "e" * 32}, PREP["student"], PREP["teacher"])
    return out


@pytest.mark.parametrize("name,extra", [("plain", []), ("env", ENV)])
def test_digests_are_pinned(name, extra):
    assert digests(extra) == PINNED[name]


# CUDA chains too (the runtime slice as given; rollout, evaluate and tooleval add what the rollout
# engine replays from graphs): a refactor of identity must not move these either
PINNED_CUDA = {
    "plain": {"policy0": "e8a4fa1612a21b72682aad1b6e13887c", "rollout2": "32babb623fdb374b9505cf314fd01491",
              "score2": "234adf19da87be158bb49685746edbc3", "update2": "e764e55cb6d957f0ecd456a139cad45c",
              "evaluate": "569011a079e2b4d51ad36a81fb2f411f", "prompts": "b791100a50953b5ceda608ff9593e2ec",
              "prepared": "14dfc67f5427a8a485b289dbdfd62eb0"},
    "env": {"policy0": "c455de3e9ec6f3ab8ee8a25e8be9003c", "rollout2": "4b821d028641ff54baf243c2a64309b9",
            "score2": "140fd143f1b52c3bb4fa1389ecfb92ed", "update2": "243d75b2c9d57c2c9e022ae4f3182fdc",
            "evaluate": "5d73b178985532c79c55fced579000a5", "tooleval": "593e0f852f57594ca979f0a1b0fce232",
            "tasks_test": "526c6c7b0224df8976d2c9683838ac2d"},
}


@pytest.mark.parametrize("name,extra", [("plain", []), ("env", ENV)])
def test_cuda_digests_are_pinned(name, extra):
    assert digests(extra, {**RUNTIME, "device": "cuda"}) == PINNED_CUDA[name]


def test_the_nf4_merge_graph_is_in_the_cuda_runtime_slice_only_where_it_runs():
    """The engine merges the LoRA into an NF4 student's dense copy in a captured graph on CUDA (it ran
    eager once): the runtime slice says so there, and nowhere else."""
    def key(*o, dev="cuda"):
        cfg = config.compose(BASE + list(o), ROOT / "conf")
        return identity.runtime_slice(cfg, dev, torch.bfloat16, lambda: 256).get("nf4_merge")

    assert key("student.quant=nf4") == "graph"
    assert key() is key("teacher.quant=nf4") is key("student.quant=nf4", "student.dense_copy=false") is None
    assert key("student.quant=nf4", "rollout.cuda_graphs=false") is key("student.quant=nf4", dev="cpu") is None


def test_the_lora_kernels_are_in_the_cuda_runtime_slice_only_where_they_run():
    """The student's LoRA branch runs as stages/weights/lora_kernels.py's kernels on CUDA unless the
    layers compile or the student is quantized (or the key is false), with or without CUDA graphs."""
    def key(*o, dev="cuda"):
        cfg = config.compose(BASE + list(o), ROOT / "conf")
        return identity.runtime_slice(cfg, dev, torch.bfloat16, lambda: 256).get("lora")

    assert key() == key("teacher.quant=nf4") == "kernels"
    assert key(dev="cpu") is key("runtime.lora_kernels=false") is key("runtime.compile_layers=true") is None
    assert key("runtime.dtype=float32") is None  # (the kernels are for bf16 and fp16 bases)
    assert key("lora.r=64") == "kernels" and key("lora.r=128") is key("lora.dropout=0.05") is None  # (PEFT's)
    assert key("student.quant=nf4") is key("student.quant=int8") is None
    eager = "runtime.cuda_graphs=false"  # (no graph: the kernels still run, and the graphs' key goes)
    assert key(eager) == key("env.name=calculator") == "kernels"
    graphs = lambda *o: identity.runtime_slice(  # noqa: E731  (the same rule names the graphed roles)
        config.compose(BASE + list(o), ROOT / "conf"), "cuda", torch.bfloat16, lambda: 256).get("forward_graphs")
    assert graphs() == ["teacher", "student"] and graphs(eager) is None
    # the teacher trains only in SFT (protocol_sft), where its LoRA takes the same rule
    teacher = lambda *o: codepaths.lora_kernels(  # noqa: E731
        config.compose(BASE + list(o), ROOT / "conf"), "teacher", "cuda")
    assert teacher() and not teacher("runtime.lora_kernels=false") and not teacher("teacher.quant=nf4")


def test_a_digest_changes_with_each_key_its_stage_reads_and_no_other():
    def chain(*extra):
        return identity.Chain(config.compose(BASE + list(extra), ROOT / "conf"), lambda: dict(RUNTIME), PREP)

    base, clamp = chain(), chain("objective.loss_max_clamp=0.5")
    assert clamp.rollout(1) == base.rollout(1)  # rollout(1) reads policy 0 and the rollout keys only
    assert clamp.update(1) != base.update(1) and clamp.rollout(2) != base.rollout(2)  # policy 1 differs
    base = digests([])
    assert digests(["memory.placement=swap"]) == base  # placement never changes what is computed
    assert digests(["rollout.cuda_graphs=false"]) == base  # (CPU: no graph is ever captured)
    # on CUDA the captured decode step and re-merge may round otherwise than eager: part of the rollout's identity
    cuda = {**RUNTIME, "device": "cuda"}
    on, off = (identity.Chain(config.compose(BASE + extra, ROOT / "conf"), lambda: dict(cuda), PREP)
               for extra in ([], ["rollout.cuda_graphs=false"]))
    assert on.rollout(1) != off.rollout(1) and on.init() == off.init()
    assert on.evaluate() != off.evaluate()  # evaluation samples with the same engine
    cpu_on, cpu_off = (identity.Chain(config.compose(BASE + extra, ROOT / "conf"), lambda: dict(RUNTIME), PREP)
                       for extra in ([], ["rollout.cuda_graphs=false"]))
    assert cpu_on.evaluate() == cpu_off.evaluate()


def test_undeclared_reads_are_refused():
    cfg = config.compose(BASE, ROOT / "conf")
    r = identity.reads(cfg, "rollout")
    assert r.rollout.n == cfg.rollout.n and r.data.max_prompt_tokens == cfg.data.max_prompt_tokens
    with pytest.raises(KeyError, match="stage 'rollout' reads config key 'data.seed' without declaring it"):
        r.data.seed
    with pytest.raises(KeyError, match="'memory'"):
        identity.reads(cfg, "score").memory
    with pytest.raises(KeyError, match="undeclared inputs"):
        identity.make("init", {}, {"student": "s", "prompts": "p"})


def test_every_declared_read_is_a_config_key():
    cfg = config.Config()
    for s in identity.STAGES.values():
        for key in s.reads:
            node = cfg
            for part in key.split("."):
                assert hasattr(node, part), f"{s.name}: {key}"
                node = getattr(node, part)


def test_dvc_params_cover_every_read_of_the_stages_a_dvc_stage_runs():
    train = dvcyaml.dvc_params("train")
    assert {"teacher_mode", "env", "sft", "train", "runtime", "student.quant", "teacher.quant"} <= set(train)
    assert "memory" not in train and not any(p.startswith("memory.") for p in train)
    prepare = dvcyaml.dvc_params("prepare")
    assert {"data", "env", "objective.topk", "student.name", "teacher.keep_layers"} <= set(prepare)


def test_dvc_yaml_is_generated_from_the_declarations():
    assert (ROOT / "dvc.yaml").read_text() == dvcyaml.render(), "run `opd dvc-yaml` and commit dvc.yaml"


def test_only_identity_computes_stage_digests():
    """Versions and digests live in stages/run/identity.py: no other module calls store.digest."""
    callers = []
    for path in sorted((ROOT / "stages").rglob("*.py")):
        if path.name in ("identity.py", "store.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("store") and \
                    any(a.name == "digest" for a in node.names):
                callers.append(str(path.relative_to(ROOT)))
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("VERSION", "VERSIONS")
                                                   for t in node.targets):
                callers.append(f"{path.relative_to(ROOT)}: VERSION")
    assert callers == []


def test_chain_needs_no_session():
    cfg = config.compose(BASE, ROOT / "conf")
    ch = identity.Chain(cfg, lambda: dict(RUNTIME), PREP)
    assert ch.policy_stage(0) == "init" and ch.policy_stage(3) == "update"
    assert dataclasses.is_dataclass(cfg)  # a plain config, no models, no store


def test_a_prompt_file_is_identified_by_its_content_not_its_path():
    files = {"rows": "e" * 32, "eval_rows": "d" * 32}
    at = lambda *o: config.compose(BASE + list(o), ROOT / "conf")  # noqa: E731
    here = at("data.path=/a/train.parquet", "data.eval_path=/a/eval.parquet")
    there = at("data.path=/elsewhere/x.parquet", "data.eval_path=relative/y.parquet")
    for fn in (lambda c: identity.prompts(c, "f" * 32, files),
               lambda c: identity.prepared(c, files, PREP["student"], PREP["teacher"])):
        assert fn(here) == fn(there)
        assert fn(here) != fn(at("data.path=/a/train.parquet"))  # the eval rows are part of it
    other = {"rows": "0" * 32, "eval_rows": "d" * 32}
    assert identity.prompts(here, "f" * 32, files) != identity.prompts(here, "f" * 32, other)  # content is
