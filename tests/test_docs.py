"""The documentation: every relative link of the README and docs/ resolves, docs/flags.md is
what the parser generates, and no document names internal work periods (a measurement is
identified by its date, device and versions)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "container" / "README.md", ROOT / "tools" / "README.md"]  # fmt: skip
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.name}: {target}"


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    block = text.split("```")[1]
    assert [ln.split("#")[0].strip() for ln in block.strip().splitlines()[1:]] == [
        "bash run.sh demo", "bash run.sh test"]  # fmt: skip


def test_run_sh_reuses_the_venv_this_checkout_is_installed_in():
    """``bash run.sh`` installs only where the venv lacks this checkout (no stamp for this
    setup.py, or megatron.md imported from elsewhere); it once read ``$PWD`` after a ``cd /``
    and reinstalled on every call."""
    import hashlib

    import megatron.md

    digest = hashlib.sha1((ROOT / "setup.py").read_bytes()).hexdigest()[:12]
    stamp = Path(sys.prefix) / f".megatron-md-{digest}"
    if not (stamp.exists() and Path(megatron.md.__file__).resolve().is_relative_to(ROOT)):
        pytest.skip("this venv is not installed from this checkout: run.sh would install")
    env = {**os.environ, "MEGATRON_MD_VENV": sys.prefix}
    out = subprocess.run(["bash", "run.sh", "no-such-command"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=env)  # fmt: skip
    assert out.returncode == 2 and "installing" not in out.stdout + out.stderr, out.stdout


def test_no_document_names_internal_work_periods():
    out = subprocess.run(
        ["git", "grep", "-n", "-I", "-i", "-E", r"\bsessions? [0-9]|\bsession-[0-9]", "--",
         "*.md", "*.py", "*.sh", "*.sbatch"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.stdout == "", out.stdout[:2000]


def test_flags_doc_is_generated_from_the_parser():
    sys.path.insert(0, str(ROOT / "tools"))
    import flags_doc

    assert (ROOT / "docs" / "flags.md").read_text() == flags_doc.markdown()
