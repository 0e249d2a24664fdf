"""The plan's printed table and its Pareto plot (bytes vs KL, speedup as the label).

``table(report)`` lists the verified candidates, then the best predicted others, with bytes,
predicted KL (RTN-based), the prediction recalibrated during verification, and measured KL; ``plot_pareto(report, "plan.png")`` draws predicted KL (hollow)
and measured KL (filled) against megabytes, with the target as a vertical line and each
point labelled by its predicted speedup. matplotlib is a core dependency of layercut.
"""

from __future__ import annotations

from pathlib import Path


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def table(report: dict, limit: int = 20) -> str:
    """The candidates as aligned text (at most ``limit`` rows beyond the verified ones)."""
    rows = [("candidate", "kept", "MB", "of bf16", "speedup", "pred KL", "calib. KL", "meas KL", "")]
    bf16 = report["bf16_bytes"]
    winner = report["winner"]["label"]
    shown = [c for c in report["candidates"] if c["verified"]] + \
        [c for c in report["candidates"] if not c["verified"]][:limit]
    for c in shown:
        size = c["measured_bytes"] or c["bytes"]
        rows.append((c["label"], str(c["kept_blocks"]), f"{size / 1e6:.1f}", f"{100 * size / bf16:.1f}%",
                     f"{c['predicted_speedup']:.2f}x", _fmt(c["predicted_kl"]), _fmt(c.get("calibrated_kl")),
                     _fmt(c["measured_kl"]),
                     "<- winner" if c["label"] == winner else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    more = len(report["candidates"]) - len(shown)
    sp = report.get("spearman_topk")
    lines.append(f"target {report['target']} = {report['target_bytes'] / 1e6:.1f} MB; {report['verified']} verified"
                 + (f", Spearman(predicted, measured) {sp:.2f}" if sp is not None else "")
                 + (f"; {more} more candidates in plan.json" if more > 0 else ""))
    return "\n".join(lines)


def plot_pareto(report: dict, path: str | Path) -> str:
    """Write the bytes-vs-KL plot; returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in report["candidates"]:
        mb = (c["measured_bytes"] or c["bytes"]) / 1e6
        color = {"uniform": "tab:blue", "mixed": "tab:green", "dense": "tab:gray"}[c["quant"]]
        ax.scatter(mb, max(c["predicted_kl"], 1e-5), facecolors="none", edgecolors=color, s=28)
        if c["measured_kl"] is not None:
            ax.scatter(mb, max(c["measured_kl"], 1e-5), color=color, s=40,
                       marker="*" if c["label"] == report["winner"]["label"] else "o")
            ax.annotate(f"{c['label']} ({c['predicted_speedup']:.2f}x)", (mb, c["measured_kl"]), fontsize=7,
                        xytext=(4, 2), textcoords="offset points")
    ax.axvline(report["target_bytes"] / 1e6, color="tab:red", linestyle="--", linewidth=1, label="target")
    ax.set_yscale("log")
    ax.set_xlabel("weight files, MB")
    ax.set_ylabel("KL to the source (held-apart calibration)")
    ax.set_title(f"{report['model']}: plan for {report['target']} (hollow: predicted, filled: measured)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name
