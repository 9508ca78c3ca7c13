"""One look for every figure of the project: a fixed colour per method in every panel and
figure (MuonMD red, as in the paper's figures), sizes in numeric order on a sequential map, and
seeds drawn as mean with their range (``cpu_repro/controls.py``). No matplotlib import here."""

from __future__ import annotations

import re

#: method (as run names and sweep metadata spell it) -> colour
METHOD_COLORS = {
    "adamw": "#1f77b4",  # blue
    "adammd": "#2ca02c",  # green
    "muon": "#ff7f0e",  # orange
    "muonmd": "#d62728",  # red (the paper's MuonMD)
    "muown": "#9467bd",  # purple
    "muownangular": "#8c564b",  # brown
    # the family's peers (docs/cpu_repro.md): the sphere alone (MD without gains), MuonH, NorMuon
    "adamsphere": "#17becf",  # cyan
    "muonsphere": "#e377c2",  # pink
    "muonh": "#7f7f7f",  # grey
    "normuon": "#bcbd22",  # olive
}


#: methods as the paper spells them (tables' rows)
METHOD_NAMES = {"adamw": "AdamW", "adammd": "AdamMD", "muon": "Muon", "muonmd": "MuonMD",
                "muown": "Muown"}  # fmt: skip


def _method_key(name: str) -> str:
    key = re.sub(r"[^a-z]", "", name.lower())
    return {"adam": "adamw", "adamwmd": "adammd"}.get(key, key)


def method_color(name: str) -> str | None:
    """The method's colour, whatever the spelling (``AdamMD``, ``adam_md``, ``muon-md``, a run
    name's method part); None for anything else (the figure's own colour cycle)."""
    return METHOD_COLORS.get(_method_key(name))


def method_name(name: str) -> str:
    """The method as the paper spells it, whatever the spelling; anything else as it came."""
    return METHOD_NAMES.get(_method_key(name), name)


def natural_key(text) -> list:
    """Digits compared as numbers: d64 < d128 < d256, 181M < 457M < 1.29B by their digits."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(text))]


def ordered_colors(keys, cmap: str = "viridis") -> dict:
    """A colour per key, in numeric order along a sequential map (widths, sizes)."""
    import matplotlib

    keys = sorted(set(keys), key=natural_key)
    cm = matplotlib.colormaps[cmap]
    return {k: cm(0.85 * i / max(len(keys) - 1, 1)) for i, k in enumerate(keys)}
