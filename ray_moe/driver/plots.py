"""PNG plots of a run: the loss curve and the expert-load heatmap (layers × experts)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def loss_curve(metrics: list[dict], path: str | Path, unit: str = "nats/byte") -> Path:
    """Train and validation loss per step; ``unit``: nats/byte (a byte corpus) or nats/token (a
    tokenized dataset)."""
    steps = [m["step"] for m in metrics if "loss" in m]
    loss = [m["loss"] for m in metrics if "loss" in m]
    evals = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, loss, label="train")
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross-entropy ({unit})")
    return _save(fig, ax, path)


def _save(fig, ax, path: str | Path) -> Path:
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def expert_load_heatmap(load: list[list[float]], path: str | Path, title: str = "",
                        blocks: list[int] | None = None) -> Path:
    """load: [MoE layers][experts] token counts; ``blocks``: the block index of each MoE layer
    (the rows are labelled with it; default 0, 1, ...)."""
    fig, ax = plt.subplots(figsize=(max(4, 0.25 * len(load[0]) + 2), 0.5 * len(load) + 1.5))
    im = ax.imshow(load, aspect="auto", cmap="viridis")
    ax.set_xlabel("logical expert")
    ax.set_ylabel("block (MoE layers)")
    ax.set_yticks(range(len(load)), [str(b) for b in (blocks if blocks is not None else range(len(load)))])
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title or "tokens per expert")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def imbalance_curve(metrics: list[dict], path: str | Path) -> Path:
    """Load imbalance (max/mean routed pairs per rank) per step, with re-cloning marked."""
    steps = [m["step"] for m in metrics if "imbalance" in m]
    imb = [m["imbalance"] for m in metrics if "imbalance" in m]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, imb, label="measured (mean over MoE layers)")
    changed = [m["step"] for m in metrics if m.get("event") == "rebalance" and m.get("layers_changed")]
    for i, step in enumerate(changed):  # named in the legend only when drawn
        ax.axvline(step, color="tab:red", alpha=0.4, lw=1, label="clone placement changed" if i == 0 else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per rank")
    return _save(fig, ax, path)
