"""stages/session.py: the tables the loop hands on (Session.table / produced_table)."""
import pyarrow as pa
import pytest

from stages import rollout
from stages.blocks import batch, tables
from stages.blocks.errors import UserError
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
    dig = sess.rollout_digest(1)
    held = sess.table("rollout", dig, "rollout.parquet", batch.ROLLOUT_NEEDS)
    assert reads == ["train.parquet"]
    on_disk = real(d / "rollout.parquet")
    assert held.equals(on_disk.replace_schema_metadata(None)) and held.num_rows == sess.cfg.rollout.batch_size
    with pytest.raises(UserError, match=r"rollout\.parquet: missing column 'nope'"):
        sess.table("rollout", dig, "rollout.parquet", {"nope": pa.int32()})
    sess.produced_table("rollout", "other", "rollout.parquet", held)  # another step's: this one is read again
    assert sess.table("rollout", dig, "rollout.parquet").equals(on_disk) and reads[-1] == "rollout.parquet"
