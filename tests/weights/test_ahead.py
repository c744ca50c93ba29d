"""stages/weights/ahead.py: jobs on one worker thread, in order, taken once by name; a failed or
empty job leaves the read to the caller (None); a model made of its weights read ahead is the model
models.load reads from its files."""
from __future__ import annotations

import threading

from stages.weights import ahead


def test_jobs_run_in_order_on_one_thread_and_are_taken_once():
    a = ahead.Ahead()
    assert not a and a.take("x") is None  # nothing started
    a.start()
    gate, seen = threading.Event(), []
    a.submit("first", lambda: gate.wait(5) and seen.append(threading.current_thread().name) or "one")
    a.submit("second", lambda: seen.append("second") or 2)
    assert a and seen == []  # the first waits on its gate, the second behind it
    gate.set()
    a.join("second")
    assert seen[0].startswith("opd-ahead") and seen[1] == "second"
    assert "first" in a and "third" not in a
    assert a.take("first") == "one" and a.take("second") == 2 and a.taken == ["first", "second"]
    assert a.take("first") is None and "first" not in a  # once


def test_a_failed_or_empty_job_is_none_and_not_counted_as_taken():
    a = ahead.Ahead()
    a.start()
    a.submit("boom", lambda: 1 / 0)
    a.submit("empty", lambda: None)
    a.join("boom")  # joined without raising
    assert a.take("boom") is None and a.take("empty") is None and a.taken == []


def test_verified_reads_only_a_dir_whose_hash_checks_out(tmp_path):
    class Store:
        def __init__(self, ok):
            self.ok = ok

        def verify(self, d):
            return self.ok

    assert ahead.verified(Store(True), tmp_path, lambda d, x: (d, x), 3) == (tmp_path, 3)
    assert ahead.verified(Store(False), tmp_path, lambda d, x: 1 / 0, 3) is None  # not read at all


def test_the_main_thread_is_favoured_until_restored():
    import sys

    before = sys.getswitchinterval()
    try:
        ahead.favour_main_thread()
        ahead.favour_main_thread()  # (a second call changes nothing, and restores to the first value)
        assert sys.getswitchinterval() == min(before, ahead.SWITCH_S) < 0.005
        ahead.restore_switch_interval()
        assert sys.getswitchinterval() == before
        ahead.restore_switch_interval()  # (nothing left to restore)
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)


def test_a_model_made_of_weights_read_ahead_is_the_one_from_its_files(tmp_path):
    """ahead.weights + models.load(weights=): transformers takes the tensors read as they are (no copy)
    and makes the model from_pretrained(dir) makes: class, config, generation config, name, parameters
    (tied ones too) to the bit, the same logits; weights stored in another dtype are not read."""
    import torch
    from engine_models import tiny

    from stages.weights import models
    from stages.run.config import ModelCfg

    tiny(seed=4).to(torch.bfloat16).save_pretrained(tmp_path)
    dev = torch.device("cpu")
    w = ahead.weights(tmp_path, dev, torch.bfloat16)
    assert w and {t.dtype for t in w.values()} == {torch.bfloat16}
    read = {t.data_ptr() for t in w.values()}
    got = models.load(tmp_path, ModelCfg(), dev, torch.bfloat16, w)
    ref = models.load(tmp_path, ModelCfg(), dev, torch.bfloat16)
    assert type(got) is type(ref) and got.config.to_dict() == ref.config.to_dict()
    assert got.generation_config.to_dict() == ref.generation_config.to_dict() and got.name_or_path == ref.name_or_path
    assert all(p.data_ptr() in read for p in got.parameters())  # taken as read
    a, b = got.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()  # tied, as from the files
    assert not any(p.requires_grad for p in got.parameters()) and not got.training
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(got(ids).logits, ref(ids).logits)
    assert ahead.weights(tmp_path, dev, torch.float32) is None  # (stored bf16: transformers would cast)


def test_a_load_from_weights_reserves_nothing_more_for_copies_it_does_not_make(tmp_path, monkeypatch):
    """transformers reserves a model's bytes on its device before loading (caching_allocator_warmup);
    tensors already there need no copies: models.load(weights=) skips it, and only for that load."""
    import torch
    import transformers.modeling_utils as mu
    from engine_models import tiny

    from stages.weights import models

    calls = []
    monkeypatch.setattr(mu, "caching_allocator_warmup", lambda *a, **k: calls.append(a))
    tiny(seed=4).to(torch.bfloat16).save_pretrained(tmp_path)
    kw = {"device_map": {"": torch.device("cpu")}}  # (a device map is what makes transformers call it)
    w = ahead.weights(tmp_path, torch.device("cpu"), torch.bfloat16)
    models._from_weights(tmp_path, w, torch.bfloat16, kw)
    assert calls == []
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, **kw)  # from the files: as before
    assert len(calls) == 1


def test_whose_weights_are_read_ahead():
    """Unquantized models of transformers' own classes; the teacher only where both stay resident
    without a memory budget (the plan's room for its bytes)."""
    from stages.run import config

    def read(*over: str, placement: str = "resident") -> list[str]:
        return ahead.weights_read(config.compose(list(over)), placement)

    assert read() == ["student", "teacher"]
    assert read(placement="swap") == read(placement="shared_backbone") == read("memory.vram_gib=8") == ["student"]
    assert read("student.quant=nf4") == ["teacher"] and read("teacher.quant=int8") == ["student"]
    assert read("student.trust_remote_code=true", "teacher.trust_remote_code=true") == []
