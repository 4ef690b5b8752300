"""The continual pre-training report (:func:`forge_experiments.cptmix.summary`) as Markdown and PNG.

Written by the orchestrator's ``cpt`` workflow (an activity; also an MLflow artifact) and by
``forge bench cpt``. matplotlib, a dependency of both, is imported only to draw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _ci(values: list[float]) -> str:
    return f"[{values[0]:.4f}, {values[1]:.4f}]"


def _runs(summary: dict[str, Any]) -> list[str]:
    """The search's runs (early-stopped ones included), the final run and the hand-over."""
    lines: list[str] = []
    search = summary.get("search") or {}
    if search.get("trials"):
        lines += ["", f"Search runs ({search.get('steps')} steps each):", ""]
        for t in search["trials"]:
            end = (
                f"stopped early at step {t['stopped_at']}" if t.get("stopped_at") is not None else "completed"
            )
            value = f", domain val_loss {t['val_loss']:.4f}" if t.get("val_loss") is not None else ""
            lines.append(
                f"- replay {t['general_fraction']:g}, peak LR {t['lr']:g}: {t['steps']} steps, {end}{value}"
            )
    if search.get("sweeps"):
        lines += ["", f"Search sweeps ({search.get('steps')} steps per run): {', '.join(search['sweeps'])}"]
    if search.get("unmeasured"):
        lines += ["", f"Completed but not measured: {'; '.join(search['unmeasured'])}."]
    for key in ("final", "handover"):
        if summary.get(key):
            pairs = ", ".join(f"{k} {v}" for k, v in summary[key].items())
            lines += ["", f"{key.capitalize()}: {pairs}."]
    return lines


def markdown(summary: dict[str, Any], *, png: str = "mixture.png") -> str:
    """The mixture curve as a table, the Pareto front, the rule and the chosen point with why."""
    base = summary.get("base", {})
    units = summary.get("units", "loss")
    lines = [
        f"# Continual pre-training: {summary.get('name', 'mixture search')}",
        "",
        f"Losses in {units}; forgetting = general loss - base's, domain gain = base's domain loss - the "
        "checkpoint's, each with the 95 % interval of the paired difference (the same documents scored "
        "by both models).",
        "",
        f"Base: `{base.get('uri', base.get('label', ''))}` - domain loss {base.get('domain_loss', float('nan')):.4f}, "
        f"general loss {base.get('general_loss', float('nan')):.4f}.",
        "",
        f"Rule: {summary['rule']['text']}.",
        "",
        "| stage | replay | peak LR | steps | domain loss (95 % CI) | general loss (95 % CI) "
        "| domain gain (95 % CI) | forgetting (95 % CI) | admissible | front | chosen |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["curve"]:
        lines.append(
            f"| {r['stage']} | {r['general_fraction']:.3g} | {r['lr']:.3g} | {r['steps']} "
            f"| {r['domain_loss']:.4f} {_ci(r['domain_ci95'])} | {r['general_loss']:.4f} {_ci(r['general_ci95'])} "
            f"| {r['domain_gain']:.4f} {_ci(r['domain_gain_ci95'])} | {r['forgetting']:.4f} {_ci(r['forgetting_ci95'])} "
            f"| {'yes' if r.get('admissible') else 'no'} | {'yes' if r.get('on_front') else ''} "
            f"| {'**yes**' if r.get('chosen') else ''} |"
        )
    lines += ["", f"Pareto front (least forgetting first): {', '.join(summary['front']) or '-'}.", ""]
    if summary.get("chosen"):
        lines.append(f"**Chosen**: {summary['reason']}.")
    else:
        lines.append(f"**Nothing chosen**: {summary['reason']}.")
    lines += _runs(summary)
    lines += ["", f"![mixture curve and Pareto front]({png})", ""]
    return "\n".join(lines)


def draw(summary: dict[str, Any], path: Path) -> Path:
    """Left: domain and general loss against the replay fraction (one line per peak LR, 95 %
    intervals, the base dashed). Right: forgetting against domain gain, the front joined, the
    chosen point starred and the rule's forgetting limit drawn."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    rows = summary["curve"]
    base = summary.get("base", {})
    fig = Figure(figsize=(12, 4.5))
    left, mid, right = fig.subplots(1, 3)
    search = [r for r in rows if r["stage"] == "search"]
    for ax, key, title in ((left, "domain", "domain loss"), (mid, "general", "general loss")):
        for lr in sorted({r["lr"] for r in search}):
            pts = sorted((r for r in search if r["lr"] == lr), key=lambda r: r["general_fraction"])
            xs = [r["general_fraction"] for r in pts]
            ys = [r[f"{key}_loss"] for r in pts]
            err = [
                [y - r[f"{key}_ci95"][0] for y, r in zip(ys, pts, strict=True)],
                [r[f"{key}_ci95"][1] - y for y, r in zip(ys, pts, strict=True)],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"search, peak LR {lr:.2g}")
        for r in rows:
            if r["stage"] != "search":
                y = r[f"{key}_loss"]
                ax.errorbar(
                    [r["general_fraction"]],
                    [y],
                    yerr=[[y - r[f"{key}_ci95"][0]], [r[f"{key}_ci95"][1] - y]],
                    marker="s",
                    color="black",
                    capsize=3,
                    label=f"{r['stage']} ({r['steps']} steps)",
                )
        if f"{key}_loss" in base:
            ax.axhline(base[f"{key}_loss"], color="grey", linestyle="--", label="base")
        ax.set_xlabel("replay fraction (general share of each batch)")
        ax.set_ylabel(f"{title} ({summary.get('units', 'loss')})")
        ax.set_title(f"{title} vs replay")
        ax.legend(fontsize=7)
    for r in rows:
        gain, forget = r["domain_gain"], r["forgetting"]
        right.errorbar(
            [gain],
            [forget],
            xerr=[[gain - r["domain_gain_ci95"][0]], [r["domain_gain_ci95"][1] - gain]],
            yerr=[[forget - r["forgetting_ci95"][0]], [r["forgetting_ci95"][1] - forget]],
            marker="*" if r.get("chosen") else ("s" if r["stage"] != "search" else "o"),
            markersize=14 if r.get("chosen") else 5,
            color="tab:red" if r.get("chosen") else ("tab:green" if r.get("on_front") else "tab:grey"),
            capsize=2,
            linestyle="none",
        )
        right.annotate(f"{r['general_fraction']:.2g}/{r['lr']:.1g}", (gain, forget), fontsize=6)
    front = sorted((r for r in rows if r.get("on_front")), key=lambda r: r["forgetting"])
    if len(front) > 1:
        right.plot([r["domain_gain"] for r in front], [r["forgetting"] for r in front], color="tab:green")
    right.axhline(summary["rule"]["max_forgetting"], color="tab:red", linestyle=":", label="max forgetting")
    right.set_xlabel("domain gain (higher is better)")
    right.set_ylabel("forgetting (lower is better)")
    right.set_title("Pareto front (labels: replay/peak LR)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write(summary: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``out/mixture.md`` and ``out/mixture.png``."""
    out.mkdir(parents=True, exist_ok=True)
    png = draw(summary, out / "mixture.png")
    md = out / "mixture.md"
    md.write_text(markdown(summary, png=png.name))
    return md, png
