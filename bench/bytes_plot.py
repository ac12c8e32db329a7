"""The accuracy-against-bytes figure the one-shot studies draw (``bench.parallel``, ``bench.grid``):
test accuracy (mean ± std over seeds, the seeds as dots) against the MB a run moved to make its
final model, on a log axis, one marker per method and one colour per Dirichlet concentration,
with the local-only and centralized references as horizontal lines."""

from __future__ import annotations

from pathlib import Path

__all__ = ["Point", "accuracy_against_bytes"]

COLOURS = ("tab:blue", "tab:red", "tab:green", "tab:purple")

# One marker: (dir key, method, x in MB, mean accuracy, std, per-seed accuracies), accuracies in [0, 1].
Point = tuple[str, str, float, float, float, list[float]]


def accuracy_against_bytes(path: Path, points: list[Point], dirichlets: dict[str, float],
                           references: dict[str, dict[str, float]], labels: dict[str, str],
                           markers: dict[str, str], methods: list[str], *, spread: str, title: str,
                           figsize: tuple[float, float]) -> list[str]:
    """Draw the figure into ``path`` (PNG, 120 dpi) and return ``[path.name]`` (``[]`` when
    ``dirichlets`` is empty).

    Args:
        points: the markers, x already spread sideways by the caller where methods move the
            same bytes (``spread`` says how, in the axis label).
        dirichlets: dir key -> its concentration, in drawing order (the first is drawn filled).
        references: dir key -> {"local_only": mean, "centralized": mean} (either may be absent).
        labels, markers: method -> legend label, matplotlib marker.
        methods: the methods in the legend, in order.
    """
    if not dirichlets:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    dirs = list(dirichlets)
    colors = dict(zip(dirs, COLOURS))
    fig, ax = plt.subplots(figsize=figsize)
    for key, method, x, mean, std, seeds in points:
        ax.errorbar([x], [100 * mean], yerr=[100 * std], marker=markers[method], color=colors[key], ms=8, capsize=3,
                    linestyle="none", mfc=colors[key] if key == dirs[0] else "none")
        for v in seeds:
            ax.plot(x, 100 * v, ".", color=colors[key], alpha=0.35, ms=4)
    for key in dirs:
        for m, ls in (("local_only", ":"), ("centralized", "--")):
            if m in references.get(key, {}):
                ax.axhline(100 * references[key][m], color=colors[key], ls=ls, lw=1, alpha=0.7)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("MB moved to produce the final model (log; chain: N − 1 hops, star: N − 1 uploads;\n"
                  f"markers at equal bytes spread sideways by {spread} for legibility)", fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    handles = [plt.Line2D([], [], marker=markers[m], color="k", ls="none", label=labels[m]) for m in methods]
    handles += [plt.Line2D([], [], color=colors[k], marker="o", mfc=colors[k] if k == dirs[0] else "none", ls="none",
                           label=f"Dirichlet({dirichlets[k]:g})") for k in dirs]
    handles += [plt.Line2D([], [], color="gray", ls=":", label="local only"),
                plt.Line2D([], [], color="gray", ls="--", label="centralized")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path.name]
