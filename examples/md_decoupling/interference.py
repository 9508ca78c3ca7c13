"""The paper's magnitude–direction interference figure (fig. interference) on its toy loss.

A scale-invariant loss of a 2-D weight: L(w) = 1 − cos(θ(w) − θ*), a function of the direction
θ(w) alone, so its gradient has no radial part. A normalized optimizer (the step's length is
the LR, as for Adam or Muon: Δw = −η ∇L/‖∇L‖) is run from the same direction at a small and a
large magnitude. Left: the landscape in polar coordinates with both paths; centre: the loss per
step (the same step turns the small weight, and changes the loss, far more: the angular step is
≈ η/‖w‖); right: ‖w‖ per step (every step is perpendicular to w, so the norm grows,
‖w_{t+1}‖² = ‖w_t‖² + η², with no radial gradient at all). MD's step (the direction on a
sphere of fixed radius, turned by η per step) is drawn for contrast: its angular step is the LR.

    python examples/md_decoupling/interference.py --out interference.png
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

TARGET = math.radians(100.0)  # θ*: the loss's minimum direction
START = math.radians(10.0)


def loss(w: np.ndarray) -> float:
    return 1.0 - math.cos(math.atan2(w[1], w[0]) - TARGET)


def grad(w: np.ndarray) -> np.ndarray:
    """∇L: tangential only, (dL/dθ)/‖w‖ along the direction of increasing θ."""
    r2 = float(w @ w)
    dl_dtheta = math.sin(math.atan2(w[1], w[0]) - TARGET)
    return dl_dtheta * np.array([-w[1], w[0]]) / r2


def normalized_path(radius: float, lr: float, steps: int) -> np.ndarray:
    """Weights of ``steps`` normalized steps Δw = −η g/‖g‖ from ``radius`` at START."""
    w = radius * np.array([math.cos(START), math.sin(START)])
    out = [w]
    for _ in range(steps):
        g = grad(w)
        n = float(np.linalg.norm(g))
        if n == 0:
            break
        w = w - lr * g / n
        out.append(w)
    return np.array(out)


def md_path(radius: float, lr: float, steps: int) -> np.ndarray:
    """MD's step: the direction turned by the LR on the sphere of ``radius`` (its norm fixed,
    the gains carry the scale), toward lower loss."""
    theta, out = START, []
    for _ in range(steps + 1):
        out.append(radius * np.array([math.cos(theta), math.sin(theta)]))
        d = math.sin(theta - TARGET)
        theta -= math.copysign(min(lr, abs(theta - TARGET)), d) if d else 0.0
    return np.array(out)


def paths(lr: float = 0.1, steps: int = 30, small: float = 0.5, large: float = 2.0) -> dict:
    return {
        f"‖w₀‖ = {small:g}": normalized_path(small, lr, steps),
        f"‖w₀‖ = {large:g}": normalized_path(large, lr, steps),
        "MD (sphere, any ‖w₀‖)": md_path(1.0, lr, steps),
    }


def draw(out: Path, lr: float = 0.1, steps: int = 30) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = paths(lr, steps)
    colors = ("tab:red", "tab:orange", "tab:gray")
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    lim = 1.2 * max(float(np.abs(p).max()) for p in ps.values())
    xs = np.linspace(-lim, lim, 200)
    xx, yy = np.meshgrid(xs, xs)
    ax[0].contourf(xx, yy, 1 - np.cos(np.arctan2(yy, xx) - TARGET), levels=20, cmap="Blues_r")
    for (name, p), c in zip(ps.items(), colors):
        ax[0].plot(p[:, 0], p[:, 1], ".-", color=c, ms=3, lw=1, label=name)
        ax[1].plot([loss(w) for w in p], color=c, label=name)
        ax[2].plot(np.linalg.norm(p, axis=1), color=c, label=name)
    ax[0].set_aspect("equal")
    ax[0].set_title("scale-invariant loss, the same normalized steps")
    ax[1].set_title("loss per step")
    ax[2].set_title("‖w‖ per step (no radial gradient)")
    for a in ax[1:]:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return ps


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("interference.png"))
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    draw(a.out, a.lr, a.steps)
    print(f"[interference] wrote {a.out}")
