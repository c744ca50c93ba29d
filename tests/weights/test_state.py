"""stages/weights/state.py: what the project keeps on a model lives in one typed `ModelState`, under
one attribute of the transformers model (issue #43): no loose private attribute on any model or
module during a run, none named in the code, and the state the same object before and after PEFT
wraps the model."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine_models import tiny, with_trained_lora
from stages import evaluate, rollout, score, train, update
from stages.memory import placement
from stages.weights import models
from stages.weights.state import ATTR, ModelState, peek, state
from support import session

ROOT = Path(__file__).resolve().parents[2]
LOOSE = "_opd_"  # the prefix the attributes this state replaced were written under


def _objects(model) -> list:
    """The model, what it wraps and every module under it: where an attribute could be set."""
    if isinstance(model, placement.SharedTeacher):
        return [model, model.get_base_model(), *_objects(model.peft)]
    return [*model.modules()]


def _loose(*roles) -> list[str]:
    return [f"{type(o).__name__}.{k}" for m in roles for o in _objects(m) for k in vars(o) if k.startswith(LOOSE)]


@pytest.mark.parametrize("over", [("memory.merge_in_place=true",),
                                  ("memory.placement=shared_backbone", "teacher.name=arch:tiny-llama",
                                   "teacher.init=random")], ids=["merge_in_place", "shared_backbone"])
def test_a_tiny_run_sets_no_loose_attribute_on_any_model(work, monkeypatch, over):
    sess = session(work, "runtime.device=cpu", "train.updates=2", "runtime.threads=1", *over)
    seen = []

    def checked(stage):  # after each stage of the loop: whatever it set is still there to see
        def run(s, *a, **kw):
            out = stage(s, *a, **kw)
            held = [m for m in (s.models._student, s.models._teacher) if m is not None]
            seen.append(len(held))
            assert _loose(*held) == [], stage.__module__
            return out
        return run

    for mod in (rollout, score, update, evaluate):
        monkeypatch.setattr(mod, "run", checked(mod.run))
    train.run(sess)
    evaluate.run(sess)  # (greedy answers of both models: the teacher's rollout engine too)
    assert len(seen) == 2 * 3 + 1 and seen[-1] == 2
    student, teacher = sess.models.student(), sess.models.teacher()
    assert _loose(student, teacher) == []
    # the state sits on the transformers models alone (the shared teacher: on its view of the student's)
    holders = {id(o) for m in (student, teacher) for o in _objects(m) if ATTR in vars(o)}
    assert holders == {id(models.base_of(student)), id(models.base_of(teacher))}
    st = state(student)
    assert isinstance(st, ModelState) and st.before_capture == sess.models.before_capture and not st.use_graphs
    assert st.forward_length == sess.models.forward_length() and st.merged is False
    assert (st.flat is not None) == ("memory.merge_in_place=true" in over)


def test_no_loose_model_attribute_is_named_in_the_code():
    hits = [f"{p.relative_to(ROOT)}:{i}" for top in ("stages", "benchmarks") for p in sorted((ROOT / top).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if LOOSE in line]
    assert hits == []


def test_the_state_made_before_peft_wraps_the_model_is_the_state_after():
    base = tiny()
    assert peek(base) is None  # (made on first use only)
    st = state(base)
    st.forward_length = 128
    peft = with_trained_lora(base)  # what Session does: fused at load, then the adapter
    assert models.base_of(peft) is base and state(peft) is st and peek(peft) is st
    assert ATTR not in vars(peft) and vars(base)[ATTR] is st
    # a wrapper that forwards unknown attributes to the model gets a state of its own, not the model's
    shared = placement.SharedTeacher(peft)
    assert state(shared) is not st and state(shared) is state(shared)
    assert state(shared).forward_length == 0
