"""Pictures of a training history: ranks per layer, and size / compression, over steps."""

from __future__ import annotations

import math
import re
from pathlib import Path

from comera_compile.training.history import History

_MAX_LEGEND = 12
_INDEX = re.compile(r"(?<![^.])\d+(?=\.|$)")  # a dotted name's numeric part: "layers.3."


def _figure(panels: int = 1):
    """A bare matplotlib Figure: no pyplot, so a user's interactive backend is left alone.
    Returns the figure and a flat list of ``panels`` axes (spare grid cells hidden)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "plots need matplotlib: pip install matplotlib (or comera_compile[dev])"
        ) from err
    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(7, 4) if panels == 1 else (4.2 * cols, 3.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


def _late_start(history: History) -> int | None:
    for r in history.records:
        if r.get("stage") == "late":
            return r["step"]
    return None


def _mark_late_start(ax, history: History) -> None:
    start = _late_start(history)
    if start is not None:
        ax.axvline(start, color="grey", linestyle="--", linewidth=1, label="late stage")


def layer_groups(names: list[str]) -> dict[str, dict[str, str]]:
    """Layers grouped by their name with block indices as ``*``: group -> {label: name},
    the label being the indices that tell the group's layers apart (or the name)."""
    groups: dict[str, dict[str, str]] = {}
    for name in names:
        group = _INDEX.sub("*", name) if name else "model"
        label = ".".join(_INDEX.findall(name)) or name or "model"
        groups.setdefault(group, {})[label] = name
    return groups


def plot_ranks(history: History, path: str | Path = "ranks.png",
               target: float | None = None) -> Path:
    """The model's size over steps (late-stage budget dashed, ``target`` dotted: by
    default the late stage's last budget, which is its target ``S_t``), then one panel per
    group of layers with the mean effective internal rank of each over steps."""
    steps = history.column("step")
    groups = layer_groups(history.layer_names())
    fig, axes = _figure(1 + len(groups))
    _plot_size(axes[0], history, target)
    columns = history.rank_columns()
    for ax, (group, members) in zip(axes[1:], groups.items()):
        for label, name in members.items():
            means = [sum(r[1:-1]) / max(len(r) - 2, 1) for r in columns[name]]
            ax.plot(steps, means, label=label, linewidth=1.2)
        _mark_late_start(ax, history)
        ax.set_title(group, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("mean effective rank", fontsize=8)
        ax.tick_params(labelsize=7)
        if len(members) <= _MAX_LEGEND:
            ax.legend(fontsize=6, title="layer" if len(members) > 1 else None,
                      title_fontsize=6)
    fig.suptitle("Rank adaptation", fontsize=10)
    return _save(fig, path)


def _plot_size(ax, history: History, target: float | None) -> None:
    """Size (the unit the trainer's target is in) with the budget and the target."""
    steps = history.column("step")
    sizes = [s if s is not None else p
             for s, p in zip(history.column("size"), history.column("params"))]
    ax.plot(steps, sizes, color="tab:blue", linewidth=1.5, label="size")
    budget = history.column("budget")
    late = [(s, b) for s, b in zip(steps, budget) if b is not None]
    if late:
        ax.plot(*zip(*late), color="tab:orange", linestyle="--", linewidth=1, label="budget")
    if target is None and late:
        target = late[-1][1]
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle=":", linewidth=1.2,
                   label=f"target {target:,.0f}")
        end = sizes[-1]
        ax.annotate(f"end {end:,} ({end / target - 1:+.1%})", (steps[-1], end),
                    textcoords="offset points", xytext=(-4, 6), ha="right", fontsize=7)
    _mark_late_start(ax, history)
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_title("model size", fontsize=8)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("parameters", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6)


def plot_compression(history: History, path: str | Path = "compression.png") -> Path:
    """Model parameters and the tensorized layers' compression ratio over steps."""
    steps = history.column("step")
    fig, (ax,) = _figure()
    ax.plot(steps, history.column("params"), color="tab:blue", label="model parameters")
    ax.set_xlabel("step")
    ax.set_ylabel("model parameters", color="tab:blue")
    _mark_late_start(ax, history)
    twin = ax.twinx()
    twin.plot(steps, history.column("compression"), color="tab:red", label="compression")
    twin.set_ylabel("tensorized layers: dense / TT parameters", color="tab:red")
    ax.set_title("Model size")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
