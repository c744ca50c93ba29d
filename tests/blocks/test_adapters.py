"""Adapter and optimizer files (stages/blocks/adapters.py): safetensors bytes written through the store's
hashing writer, so sealing takes their hash from memory; the bytes are safetensors' own."""
from __future__ import annotations

import torch
import xxhash
from safetensors.torch import save_file

from stages.blocks import adapters, store


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
