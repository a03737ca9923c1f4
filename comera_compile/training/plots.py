"""Pictures of a training history: ranks per layer, and size / compression, over steps.

matplotlib runs on the Agg backend (files only, no display), imported lazily so the rest
of the package does not need it.
"""

from __future__ import annotations

from pathlib import Path

from comera_compile.training.history import History

_MAX_LEGEND = 12


def _figure():
    """A bare matplotlib Figure: no pyplot, so a user's interactive backend is left alone."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "plots need matplotlib: pip install matplotlib (or comera_compile[dev])"
        ) from err
    fig = Figure(figsize=(7, 4))
    return fig, fig.subplots()


def _late_start(history: History) -> int | None:
    for r in history.records:
        if r.get("stage") == "late":
            return r["step"]
    return None


def _mark_late_start(ax, history: History) -> None:
    start = _late_start(history)
    if start is not None:
        ax.axvline(start, color="grey", linestyle="--", linewidth=1, label="late stage")


def plot_ranks(history: History, path: str | Path = "ranks.png") -> Path:
    """Mean effective internal rank of each tensorized layer over steps."""
    steps = history.column("step")
    fig, ax = _figure()
    for name, per_step in history.rank_columns().items():
        means = [sum(r[1:-1]) / max(len(r) - 2, 1) for r in per_step]
        ax.plot(steps, means, label=name or "model", linewidth=1.2)
    _mark_late_start(ax, history)
    ax.set_xlabel("step")
    ax.set_ylabel("mean effective rank")
    ax.set_title("Rank adaptation")
    if len(history.layer_names()) <= _MAX_LEGEND:
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_compression(history: History, path: str | Path = "compression.png") -> Path:
    """Model parameters and the tensorized layers' compression ratio over steps."""
    steps = history.column("step")
    fig, ax = _figure()
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
