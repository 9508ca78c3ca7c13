"""megatron/md/train/nodes.py: a rank that runs other software than rank 0 (a node with its own,
stale checkout of megatron-md, or another torch) stops the run before it trains. Two gloo ranks,
rank 1 importing megatron-md from a copy whose one comment differs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _nodes import ROOT

from megatron.md import errors
from megatron.md.launch import free_port

pytestmark = pytest.mark.distributed

CHECK = r"""
import os
import sys
if len(sys.argv) > 1:
    import megatron.core.optimizer  # a training run's check sees megatron-core imported
import torch.distributed as dist
from megatron.md import errors
from megatron.md.train import nodes, shutdown
dist.init_process_group("gloo")
with errors.one_line():
    nodes.check_same_software()
os.write(1, b"same\n")
shutdown.exit_now()
"""


def two_ranks(paths: list[str], *args: str) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", CHECK, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd="/",
                              env={**env, "RANK": str(r), "LOCAL_RANK": "0",
                                   "PYTHONPATH": paths[r]})
             for r in (0, 1)]  # fmt: skip
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


def test_ranks_running_other_megatron_md_code_are_refused(tmp_path):
    copy = tmp_path / "node2"
    shutil.copytree(ROOT / "megatron" / "md", copy / "megatron" / "md",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    same = two_ranks([str(ROOT), str(copy)])
    assert [(o.returncode, o.stdout) for o in same] == [(0, "same\n")] * 2, same
    f = copy / "megatron" / "md" / "reference.py"
    f.write_text(f.read_text() + "# an older checkout\n")
    outs = two_ranks([str(ROOT), str(copy)])
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs
    err = outs[0].stderr
    assert err.startswith("pretrain_gpt.py: error: rank 1 on "), err
    assert "runs other software than rank 0 on " in err and "megatron-md source " in err
    assert "torch" not in err.split("software than rank 0")[1].split("Its ranks")[0]
    assert outs[1].stderr == ""


def test_ranks_running_another_megatron_core_of_the_same_version_are_refused(tmp_path):
    """A node whose megatron-core is another checkout reporting the same version (installed in
    place from git: the version changes at releases only): rank 1 imports megatron-core from a
    copy whose distrib_optimizer.py has one more line. Refused, naming that module and only it
    (the copy's other modules are megatron-core's own)."""
    import megatron.core

    copy = tmp_path / "node2"
    shutil.copytree(Path(megatron.core.__file__).parent, copy / "megatron" / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    f = copy / "megatron" / "core" / "optimizer" / "distrib_optimizer.py"
    f.write_text(f.read_text() + "# a later commit\n")
    outs = two_ranks([str(ROOT), f"{copy}:{ROOT}"], "import megatron-core")
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs
    err = outs[0].stderr.strip().splitlines()[-1]  # after megatron-core's import warnings
    assert err.startswith("pretrain_gpt.py: error: rank 1 on "), err
    named = err.split("runs other software than rank 0 on ")[1].split(": ", 1)[1]
    assert named.startswith(
        "the source of megatron.core.optimizer.distrib_optimizer (not rank 0's: the same "
        "versions from another checkout?). Its ranks would"
    ), err
    assert "error" not in outs[1].stderr
