"""stages/session.py: the tables the loop hands on (Session.table / hand_on)."""
import pyarrow as pa
import pytest

from stages import rollout
from stages.engine import batch
from stages.rows import tables
from stages.errors import UserError
from support import session


def test_a_steps_rollout_goes_on_from_memory_and_equals_its_published_file(work, monkeypatch):
    """Score and update take the rollout the step produced without reading its file; the published
    file holds the same table; a table read from the store is read once; a held table is still checked
    for the columns the caller needs (a one-line error naming the file)."""
    sess = session(work, "runtime.threads=1")
    from stages import train

    train.policy0(sess)
    reads: list[str] = []
    real = tables.read
    monkeypatch.setattr(tables, "read", lambda path, required=None: reads.append(path.name) or real(path, required))
    d = rollout.run(sess, 1)
    assert reads == ["train.parquet"]  # the prompts, read once
    rollout.run(sess, 1)  # published: nothing produced, nothing read again
    dig = sess.chain.rollout(1)
    held = sess.table("rollout", dig, "rollout.parquet", batch.ROLLOUT_NEEDS)
    assert reads == ["train.parquet"]
    on_disk = real(d / "rollout.parquet")
    assert held.equals(on_disk.replace_schema_metadata(None)) and held.num_rows == sess.cfg.rollout.batch_size
    with pytest.raises(UserError, match=r"rollout\.parquet: missing column 'nope'"):
        sess.table("rollout", dig, "rollout.parquet", {"nope": pa.int32()})
    sess.hand_on("rollout", "other", "rollout.parquet", held, {}, {})  # another step's: this one is read again
    assert sess.table("rollout", dig, "rollout.parquet").equals(on_disk) and reads[-1] == "rollout.parquet"


def test_a_publish_that_fails_on_the_worker_thread_fails_the_stage_command(work, monkeypatch, capsys):
    """CUDA publishes rollout, scores and update on a worker thread (forced here on the CPU). When
    that write fails (a full disk), `opd stage rollout --step 1` must not print the path and exit 0:
    the command joins the publish before it reports and exits with the full-disk error; nothing is
    left published."""
    import threading

    from stages import cli
    from stages.session import Session
    from support import TINY

    monkeypatch.setattr(Session, "background_publish", property(lambda s: True))
    real = tables.write

    def failing(path, table, meta):
        if path.name == "rollout.parquet":
            assert threading.current_thread().name.startswith("opd-publish")
            raise OSError(28, "No space left on device")
        real(path, table, meta)

    monkeypatch.setattr(tables, "write", failing)
    code = cli.main(["stage", "rollout", "--step", "1", *TINY, "runtime.threads=1"])
    out = capsys.readouterr()
    assert code == cli.EXIT_NO_SPACE and "no space left on device" in out.err
    assert "rollout step 1:" not in out.out
    assert not list((work / "artifacts" / "store" / "rollout").glob("[0-9a-f]*"))  # no dir published


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_checkpointing_stashes_rng_state_only_with_lora_dropout(work, dropout):
    """train.activation_checkpointing: each decoder layer recomputes in the backward (non-reentrant);
    the RNG state is stashed around the recompute only when the forward draws (LoRA dropout), since
    a captured CUDA graph refuses the generator query and nothing draws without dropout."""
    from stages.weights import models

    sess = session(work, "runtime.threads=1", "train.activation_checkpointing=true", f"lora.dropout={dropout}")
    layer = models.base_of(sess.models.student()).model.layers[0]
    assert layer.gradient_checkpointing
    assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False, "preserve_rng_state": dropout > 0}


def test_reads_ahead_give_the_same_models_and_policy_0_and_a_damaged_dir_is_recomputed_in_line(work):
    """Resident.load_ahead (CUDA runs start it; here on the CPU): the models' weights, the tokenizer and
    the teacher made of its weights come from its thread, bit for bit what the in-line loads give, and
    the student's LoRA (drawn from the global generator while the teacher loads) is the same; a teacher
    dir whose hash fails is not read ahead: the in-line path recomputes it, warning once; weights
    stored in another dtype than the run's are read from the files, as before."""
    import torch

    from stages.weights import models

    # bf16 as the models are stored (the weights are read ahead only in the dtype the run computes in)
    plain = session(work, "runtime.threads=1", "runtime.dtype=bfloat16")
    lora = {n: p.detach().clone() for n, p in models.trainable(plain.models.student())}
    # (copied: loaded in the dtype stored, CPU tensors may map the file, which the damage below rewrites)
    teacher = {k: v.clone() for k, v in plain.models.teacher().state_dict().items()}
    sess = session(work, "runtime.threads=1", "runtime.dtype=bfloat16")
    sess.models.load_ahead()
    assert {n: p for n, p in models.trainable(sess.models.student())}.keys() == lora.keys()
    assert all(torch.equal(p, lora[n]) for n, p in models.trainable(sess.models.student()))
    assert sess.models.tokenizer().eos_token_id == plain.models.tokenizer().eos_token_id
    got = sess.models.teacher().state_dict()
    assert got.keys() == teacher.keys() and all(torch.equal(got[k], teacher[k]) for k in teacher)
    assert sess.models.loaded_ahead() == ["student_weights", "teacher_weights", "tokenizer", "teacher"]  # (as taken)

    d = sess.store.path("model", sess.prepared["teacher"])
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-64:] = bytes(64)  # same size (prepare's shallow check passes), another hash (the deep one fails)
    f.write_bytes(bytes(raw))
    again = session(work, "runtime.threads=1", "runtime.dtype=bfloat16")
    again.store.verify_soon(d)
    again.models.load_ahead()
    again.models.student()
    got = again.models.teacher().state_dict()
    assert all(torch.equal(got[k], teacher[k]) for k in teacher)  # recomputed in line, the same weights
    assert again.models.loaded_ahead() == ["student_weights"]  # (its dir is undamaged)
    assert again.models.tokenizer() is not None and again.models.loaded_ahead() == ["student_weights", "tokenizer"]
    fp32 = session(work, "runtime.threads=1")  # stored bf16, computed in fp32: the teacher is read from its files
    fp32.models.load_ahead()
    fp32.models.student()
    assert fp32.models.teacher().dtype == torch.float32 and fp32.models.loaded_ahead() == ["teacher"]
