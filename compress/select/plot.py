"""PNG of per-layer scores with the selected layers highlighted (matplotlib, Agg backend).

Usage::

    from layercut.compress.select.plot import plot_scores
    plot_scores(scores, "scores.png", highlight={"block_influence": [12, 13, 25]})

    layercut score MODEL --method all --span 8 --plot scores.png

One panel per available score series (block influence, sublayer cosines, angular d(l, n),
Gate-Norm, swap-KL). ``highlight`` is a list of layer indices (marked on every panel) or
a dict {series name: indices}. The file is written to a temporary sibling and renamed, so
a failed plot leaves nothing behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from layercut.compress.core.errors import LayercutError
from layercut.compress.select.driver import LayerScores

SERIES = (
    ("block_influence", "block influence 1 − cos(h_l, h_l+1)"),
    ("attn_importance", "attention importance (LLM-Drop)"),
    ("mlp_importance", "MLP importance (LLM-Drop)"),
    ("angular", "angular d(l, n), last token"),
    ("angular_all", "angular d(l, n), all tokens"),
    ("gate_norm", "Gate-Norm ‖W_Q W_Kᵀ‖_F"),
)


def _series(scores: LayerScores | dict[str, list[float]]) -> list[tuple[str, str, list[float]]]:
    if isinstance(scores, LayerScores):
        out = [(name, title, getattr(scores, name)) for name, title in SERIES if getattr(scores, name) is not None]
        span = f"d(l, {scores.span})"
        out = [(n, t.replace("d(l, n)", span) if n.startswith("angular") else t, v) for n, t, v in out]
        if scores.swap_kl:
            out.append(("swap_kl", "swap KL d_int(i, i+1)", scores.swap_kl["interchange"]))
        return out
    return [(name, name, list(values)) for name, values in scores.items()]


def plot_scores(
    scores: LayerScores | dict[str, list[float]],
    path: str | os.PathLike,
    highlight: list[int] | dict[str, list[int]] | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG with one bar panel per score series; highlighted layers in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(path)
    if target.suffix.lower() != ".png":
        raise LayercutError(f"plot file must end in .png (got {target.name})")
    series = _series(scores)
    if not series:
        raise LayercutError("no scores to plot")
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 2.2 * len(series) + 0.6), squeeze=False)
    for ax, (name, label, values) in zip(axes[:, 0], series):
        marked = set(highlight.get(name, []) if isinstance(highlight, dict) else (highlight or []))
        colors = ["tab:red" if i in marked else "tab:blue" for i in range(len(values))]
        ax.bar(range(len(values)), values, color=colors)
        picked = f" — selected {sorted(marked)}" if marked else ""
        if marked and name.startswith("angular") and isinstance(scores, LayerScores) and len(marked) == 1:
            first = min(marked)  # the angular x axis is the span start l*
            picked = f" — selected span {first}–{first + scores.span - 1}"
        ax.set_title(label + picked, fontsize=9)
        ax.set_xlim(-0.6, len(values) - 0.4)
        ax.tick_params(labelsize=8)
    axes[-1, 0].set_xlabel("layer (angular: span start l)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".png", dir=target.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
