"""A save that cannot write: the line rank 0 says (savefail.py) and the checksum thread's
failure (digest.py). The whole path, on real ranks and a real failed write:
test_pretrain_e2e.py::test_a_save_that_cannot_write_ends_in_one_line_and_keeps_the_previous."""

import inspect

import pytest

from megatron.md import compat
from megatron.md.train import digest, savefail

pytestmark = pytest.mark.quick


def test_the_line_names_ranks_files_free_space_and_the_checkpoint_kept(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    (tmp_path / "iter_0000020").mkdir()
    (tmp_path / "iter_0000020" / "__1_0.distcp").write_bytes(b"x" * (3 << 20))
    enospc = "OSError: [Errno 28] No space left on device"
    short = "RuntimeError: unexpected pos 704 vs 598: a short write"
    failures = [(0, "__0_0.distcp", short), (1, "__1_0.distcp", enospc),
                (3, "__3_0.distcp", enospc), (3, "__3_1.distcp", enospc)]  # fmt: skip
    line = savefail.describe(failures, str(tmp_path), 20)
    assert line.startswith(f"--save {tmp_path}: saving iteration 20 failed: rank 1 could not "
                           f"write __1_0.distcp ({enospc}); rank 3 could not write")  # fmt: skip
    assert "; and 1 more;" in line  # four failures, the OS errors first, three named
    assert "its filesystem has " in line and " free" in line
    assert "iter_0000020 is incomplete (3 MiB;" in line
    assert "the latest checkpoint is still iteration 10" in line


def test_with_no_earlier_checkpoint_the_line_says_so(tmp_path):
    line = savefail.describe([(0, "__0_0.distcp", "OSError: x")], str(tmp_path), 10)
    assert "no earlier checkpoint is there" in line and "incomplete" not in line


def test_the_writer_seam_stays_a_static_method(monkeypatch):
    """megatron calls it through the class and, for its multi-storage client, reads its
    signature (``write_preloaded_data_multithread``); applied twice, it wraps the original
    once."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync as W,
    )

    row = [s for s in compat.SEAMS if s.path == "FileSystemWriterAsync.write_preloaded_data"]
    original = inspect.getattr_static(W, "write_preloaded_data")
    monkeypatch.setattr(W, "write_preloaded_data", original)  # restored after the test
    monkeypatch.setattr(compat, "SEAMS", tuple(row))
    compat.apply("training")
    compat.apply("training")
    assert isinstance(inspect.getattr_static(W, "write_preloaded_data"), staticmethod)
    fn = W.write_preloaded_data
    assert fn.__md_seam__ is original.__func__
    assert "write_bucket" in inspect.signature(fn).parameters


def test_a_checksum_file_that_cannot_be_written_is_said_not_raised(tmp_path, capsys):
    ckpt = tmp_path / "iter_0000010"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"shard")
    (ckpt / f"{digest.PREFIX}0.json.tmp").mkdir()  # its temporary file cannot be opened
    digest._write(str(ckpt), 0)
    assert "rank 0: the checksums of" in capsys.readouterr().err
    assert not (ckpt / f"{digest.PREFIX}0.json").exists()


def test_a_filesystem_without_room_for_the_next_checkpoint_is_warned_of(tmp_path, monkeypatch):
    """The real free space of tmp_path's filesystem against a checkpoint as large (no warning)
    and one sparse file larger than it (the warning, naming both sizes)."""
    import shutil

    monkeypatch.setenv("RANK", "0")
    ckpt = tmp_path / "iter_0000010"
    ckpt.mkdir()
    with open(ckpt / "__0_0.distcp", "wb") as f:
        f.truncate(1 << 20)
    assert savefail.warn_if_no_room(str(tmp_path), str(ckpt), "this checkpoint") is None
    with open(ckpt / "__0_0.distcp", "wb") as f:  # sparse: its size, not its blocks
        f.truncate(shutil.disk_usage(tmp_path).free + (1 << 30))
    msg = savefail.warn_if_no_room(str(tmp_path), str(ckpt), "this checkpoint")
    assert msg and f"--save {tmp_path}: its filesystem has " in msg
    assert "this checkpoint takes " in msg and "the next save will fail" in msg
    monkeypatch.setenv("RANK", "1")  # said once, by rank 0
    assert savefail.warn_if_no_room(str(tmp_path), str(ckpt), "this checkpoint") is None
