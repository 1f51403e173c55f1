"""The plots say what they show: the loss's unit, the marks drawn, the blocks' own numbers."""

from __future__ import annotations

import pytest

from ray_moe.driver import plots
from ray_moe.driver.metrics import MetricsLog


@pytest.fixture
def figures(monkeypatch):
    shown: list = []
    monkeypatch.setattr(plots.plt, "close", shown.append)  # keep each figure to look at
    return shown


def _records():
    return [{"step": s, "loss": 3.0 - 0.1 * s, "imbalance": 1.2, "expert_tokens": [[1, 2, 3, 4], [4, 3, 2, 1]]}
            for s in (1, 2, 3)]


def test_a_token_run_plots_nats_per_token_and_heatmap_rows_are_blocks(tmp_path, figures):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.start_fresh()
    for r in _records():
        log.record(r)
    log.plot(tmp_path, "nats/token", blocks=[1, 3])
    loss, imbalance, heat = (f.axes[0] for f in figures)
    assert loss.get_ylabel() == "cross-entropy (nats/token)"
    assert heat.get_ylabel() == "block (MoE layers)"
    assert [t.get_text() for t in heat.get_yticklabels()] == ["1", "3"]
    # no re-cloning in this run: no red marks, and none mentioned
    assert "red" not in imbalance.get_xlabel()
    assert [t.get_text() for t in imbalance.get_legend().get_texts()] == ["measured (mean over MoE layers)"]
    log.close()


def test_the_imbalance_plot_names_the_marks_it_draws(tmp_path, figures):
    records = _records() + [{"event": "rebalance", "step": 2, "layers_changed": 1}]
    plots.imbalance_curve(records, tmp_path / "imbalance.png")
    ax = figures[0].axes[0]
    assert "clone placement changed" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(line.get_color() == "tab:red" for line in ax.get_lines())
