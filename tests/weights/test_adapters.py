"""Adapter and optimizer files (stages/weights/adapters.py): safetensors bytes written through the store's
hashing writer, so sealing takes their hash from memory; the bytes are safetensors' own."""
from __future__ import annotations

import torch
import xxhash
from safetensors.torch import load_file as safe_load, save_file

from stages.weights import adapters
from stages.run import store


def test_optimizer_file_is_hashed_as_written_and_equals_save_file(tmp_path, monkeypatch):
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(4, 3)
    opt.step()
    path, ref = tmp_path / "optimizer.safetensors", tmp_path / "ref.safetensors"
    adapters.save_optimizer(opt, [("w", p)], path)
    st = opt.state[p]
    save_file({"w.exp_avg": st["exp_avg"], "w.exp_avg_sq": st["exp_avg_sq"],
               "__step__": torch.as_tensor(st["step"], dtype=torch.float32).reshape(())}, ref)
    assert path.read_bytes() == ref.read_bytes()

    def no_reread(_path):
        raise AssertionError("sealing read the file back")

    # the hash recorded while writing is the file's hash, and sealing takes it without reading the file
    monkeypatch.setattr(store, "file_hash", no_reread)
    assert store.written_hash(path) == xxhash.xxh3_128_hexdigest(ref.read_bytes())


def _random_tensors(g: torch.Generator) -> dict:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool,
              torch.float64, torch.int8, torch.int16]
    out = {}
    for i in range(int(torch.randint(0, 12, (), generator=g))):
        dt = dtypes[int(torch.randint(0, len(dtypes), (), generator=g))]
        shape = [int(x) for x in torch.randint(0, 4, (int(torch.randint(0, 4, (), generator=g)),), generator=g)]
        t = (torch.randn(shape, generator=g) * 100).to(dt)
        out[f"layer.{int(torch.randint(0, 30, (), generator=g))}.w{i}"] = t
    return out


def test_save_tensors_writes_the_bytes_safetensors_writes(tmp_path):
    """Own writer (no serialised copy held under the interpreter lock), safetensors' format byte for
    byte: dtype order, name order, header padding, metadata, 0-d and empty tensors, an empty file."""
    from safetensors.torch import load_file, save

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        ts = _random_tensors(g)
        meta = {"format": "pt"} if trial % 2 else None
        path = tmp_path / f"{trial}.safetensors"
        adapters.save_tensors(path, ts, metadata=meta)
        assert path.read_bytes() == save(ts, metadata=meta), trial
        back = load_file(path)
        assert all(torch.equal(back[n], t) for n, t in ts.items())
        assert store.written_hash(path) == xxhash.xxh3_128_hexdigest(path.read_bytes())


def test_save_tensors_of_views_into_shared_buffers_writes_safetensors_bytes(tmp_path):
    """Tensors that are views of one buffer (what host_copy gives), back to back in the file's order
    or not, among others of other buffers and non-contiguous ones: safetensors' bytes still."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(1)
    for trial in range(100):
        ts = want = _random_tensors(g)
        if trial % 3 == 0:  # through host_copy: views of one buffer per dtype, laid out in the file's order
            ts = adapters.host_copy(ts)()
            assert {n: t.shape for n, t in ts.items()} == {n: t.shape for n, t in want.items()}
        elif ts:  # views of one buffer in a shuffled order, one transposed
            names = list(ts)
            order = torch.randperm(len(names), generator=g).tolist()
            flat = torch.cat([ts[names[i]].to(torch.float32).reshape(-1) for i in order])
            sizes = [ts[names[i]].numel() for i in order]
            ts = {names[i]: piece.view(ts[names[i]].shape) for i, piece in zip(order, flat.split(sizes))}
            ts["t"] = torch.randn(3, 2, generator=g).t()
            want = ts
        path = tmp_path / f"{trial}.safetensors"
        adapters.save_tensors(path, ts)
        assert path.read_bytes() == save({n: t.contiguous() for n, t in want.items()}), trial


def test_a_snapshot_and_its_file_take_torch_calls_and_writes_per_dtype_not_per_tensor(tmp_path, monkeypatch):
    """Each torch call that computes (a view, a reshape) and each write gives the interpreter lock up,
    and waits for it up to the switch interval behind a thread running Python (the read-ahead thread
    while policy 0 is published): their number must not grow with the adapter's tensors."""
    from torch.overrides import TorchFunctionMode

    # reads of a tensor's metadata, which keep the lock (benchmarks/switch_interval.py's module docstring)
    keeps_lock = {"__get__", "numel", "element_size", "is_contiguous", "untyped_storage", "storage_offset",
                  "data_ptr", "_set_grad_enabled"}

    class Calls(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Calls.n += getattr(func, "__name__", "") not in keeps_lock
            return func(*args, **(kwargs or {}))

    parts = []
    real = store.write_bytes
    monkeypatch.setattr(adapters, "write_bytes", lambda path, *p: (parts.append(len(p)), real(path, *p)))
    counts = []
    for n in (4, 200):
        ts = {f"base_model.layers.{i}.lora_{ab}.weight": torch.nn.Parameter(torch.randn(8, 4))
              for i in range(n) for ab in "AB"}
        ts["__step__"] = torch.tensor(3.0, dtype=torch.float64)
        Calls.n = 0
        with Calls():
            snap = adapters.host_copy(ts)()
            adapters.save_tensors(tmp_path / f"{n}.safetensors", snap)
        counts.append(Calls.n)
        assert not any(t.requires_grad for t in snap.values())  # (parameters in: no autograd record)
    assert counts[0] == counts[1] and counts[1] < 20, counts
    assert parts == [2 + 2, 2 + 2]  # length and header, then one run per dtype
    back = safe_load(tmp_path / "200.safetensors")
    assert torch.equal(back["base_model.layers.7.lora_B.weight"], ts["base_model.layers.7.lora_B.weight"].detach())


def test_host_copy_is_a_snapshot_of_the_values_when_called():
    a, b, c = torch.randn(3, 2), torch.randn(5), torch.arange(4)
    want = {"a": a.clone(), "b": b.clone(), "c": c.clone()}
    later = adapters.host_copy({"a": a, "b": b, "c": c})
    a.add_(1.0)  # what an optimizer step does to the live tensors after the snapshot
    c.mul_(3)
    got = later()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert got["a"].shape == (3, 2) and got["c"].dtype == torch.int64


def test_adapter_state_names_and_values_are_peft_s_and_follow_the_live_parameters(tmp_path):
    from peft import get_peft_model_state_dict

    from stages.weights import lora, models
    from stages.run.config import LoraCfg
    from engine_models import tiny

    student = lora.add(tiny(), LoraCfg(), 0)
    ref = get_peft_model_state_dict(student, save_embedding_layers=False)
    got = adapters.adapter_state(student)
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    with torch.no_grad():  # a training step changes the parameters in place: the cached names read them
        for _, p in models.trainable(student):
            p.add_(0.5)
    ref, got = get_peft_model_state_dict(student, save_embedding_layers=False), adapters.adapter_state(student)
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    # and the adapter dir written from a snapshot is the one PEFT's own walk gives
    adapters.save_adapter(student, tmp_path / "a", "opd-store/model/x")
    from safetensors.torch import save
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == \
        save({k: v.contiguous() for k, v in sorted(ref.items())}, metadata={"format": "pt"})


def test_set_training_matches_module_train():
    from stages.weights import lora, models
    from stages.run.config import LoraCfg
    from engine_models import tiny

    student = lora.add(tiny(), LoraCfg(dropout=0.1), 0)
    for on in (True, False, True):
        models.set_training(student, on)
        assert all(m.training is on for m in student.modules())
    student.train(False)
    assert not any(m.training for m in student.modules())


def test_per_model_caches_do_not_keep_a_model_alive():
    """set_training and adapter_state cache per model (weak keys): a dropped model is freed, its
    device memory with it (a session's models must not outlive it)."""
    import gc
    import weakref

    from stages.weights import lora, models
    from stages.run.config import LoraCfg
    from engine_models import tiny

    student = lora.add(tiny(), LoraCfg(), 0)
    models.set_training(student, True)
    adapters.adapter_state(student)
    alive = weakref.ref(student)
    del student
    gc.collect()
    assert alive() is None
