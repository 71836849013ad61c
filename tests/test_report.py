"""The run's curves (bertforge.train.report): an SVG drawn from metrics.jsonl, read back here as XML."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bertforge.train.report import HEIGHT, WIDTH, plot_metrics, ticks

SVG = "{http://www.w3.org/2000/svg}"


def write_log(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # json writes NaN as NaN, as the trainer does
    return path


def lines(svg: Path) -> dict[str, list[list[tuple[float, float]]]]:
    """Each series' polylines (label -> list of point lists) in the order drawn."""
    found: dict[str, list] = {}
    for line in ET.parse(svg).getroot().iter(f"{SVG}polyline"):
        points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
        found.setdefault(line.get("data-label"), []).append(points)
    return found


def texts(svg: Path) -> list[str]:
    return [t.text for t in ET.parse(svg).getroot().iter(f"{SVG}text")]


def test_each_series_is_drawn_through_its_points_within_its_panel(tmp_path):
    train = [{"split": "train", "step": s, "loss": 10.0 - s, "mlm_loss": 8.0 - s / 2} for s in range(1, 9)]
    evals = [{"split": "eval", "step": s, "mlm_accuracy": 0.1 * s, "mlm_loss": 3.0, "time": 5.0} for s in (4, 8)]
    svg = plot_metrics(write_log(tmp_path / "metrics.jsonl", train + evals), tmp_path / "curves.svg")
    assert svg == tmp_path / "curves.svg"
    root = ET.parse(svg).getroot()
    assert (root.get("width"), root.get("height")) == (str(WIDTH), str(HEIGHT))
    drawn = lines(svg)
    assert sorted(drawn) == ["loss", "mlm_accuracy", "mlm_loss"]  # eval losses and the clock are left out
    (loss,), (accuracy,) = drawn["loss"], drawn["mlm_accuracy"]
    assert len(loss) == 8 and len(accuracy) == 2
    xs, ys = [x for x, _ in loss], [y for _, y in loss]
    assert xs == sorted(xs) and len(set(xs)) == 8  # one point a step, left to right
    assert ys == sorted(ys)  # a falling loss goes down the picture (SVG's y grows downwards)
    steps = [(x - xs[0]) / (xs[-1] - xs[0]) for x in xs]
    assert steps == pytest.approx([s / 7 for s in range(8)], abs=1e-3)  # evenly spaced steps, evenly spaced
    assert all(0 < x < WIDTH / 2 for x in xs) and all(WIDTH / 2 < x < WIDTH for x, _ in accuracy)
    assert all(0 < y < HEIGHT for _, y in loss + accuracy)
    assert accuracy[1][1] < accuracy[0][1]  # the accuracy rises
    assert len(list(root.iter(f"{SVG}circle"))) == 2  # evaluations are marked
    legend = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "legend"]
    assert legend == ["loss", "mlm_loss", "mlm_accuracy"]
    assert {"training", "evaluation", "step", "training loss"} <= set(texts(svg))


def test_a_non_finite_loss_breaks_the_line_and_does_not_set_the_scale(tmp_path):
    losses = [4.0, 3.0, math.nan, 2.0, math.inf, 1.0]
    train = [{"split": "train", "step": s, "loss": v} for s, v in enumerate(losses, 1)]
    svg = plot_metrics(write_log(tmp_path / "m.jsonl", train), tmp_path / "c.svg")
    pieces = lines(svg)["loss"]
    assert [len(p) for p in pieces] == [2, 1, 1]
    assert all(math.isfinite(v) for p in pieces for xy in p for v in xy)
    labels = [float(t.replace(",", "")) for t in texts(svg) if t and t.replace(",", "").replace(".", "").isdigit()]
    assert max(labels) < 100  # the axes' labels: steps and losses, no infinity stretching the scale


def test_a_continued_run_is_drawn_after_the_one_it_continues_with_a_line_between(tmp_path):
    first = write_log(tmp_path / "first.jsonl", [{"split": "train", "step": s, "loss": 5.0} for s in (1, 2, 3, 4)])
    second = write_log(tmp_path / "second.jsonl", [{"split": "train", "step": s, "loss": 4.0} for s in (1, 2)])
    svg = plot_metrics(second, tmp_path / "c.svg", earlier=first)
    (points,) = lines(svg)["loss"]
    assert len(points) == 6 and [x for x, _ in points] == sorted(x for x, _ in points)  # steps 1-4, then 5, 6
    dashed = [d for d in ET.parse(svg).getroot().iter(f"{SVG}line") if d.get("stroke-dasharray")]
    assert len(dashed) == 2  # in each panel
    assert points[3][0] == pytest.approx(float(dashed[0].get("x1")))  # at the earlier run's last step (4)


def test_an_empty_log_draws_nothing(tmp_path):
    assert plot_metrics(write_log(tmp_path / "m.jsonl", []), tmp_path / "c.svg") is None
    assert plot_metrics(tmp_path / "missing.jsonl", tmp_path / "c.svg") is None
    assert not (tmp_path / "c.svg").exists()


def test_evaluations_alone_leave_the_training_panel_empty_and_say_so(tmp_path):
    svg = plot_metrics(write_log(tmp_path / "m.jsonl", [{"split": "eval", "step": 3, "accuracy": 0.5}]),
                       tmp_path / "c.svg")
    assert list(lines(svg)) == ["accuracy"] and "none logged" in texts(svg)


@pytest.mark.parametrize("lo,hi", [(0, 1), (0.95, 4.2), (1, 60), (0, 14435), (-0.5, 0.5), (2.1234, 2.1236),
                                   (0.31, 0.66), (1e-7, 3e-7)])
def test_ticks_are_round_evenly_spaced_and_inside_the_range(lo, hi):
    values, decimals = ticks(lo, hi)
    assert 3 <= len(values) <= 8
    assert all(lo - 1e-12 <= v <= hi + 1e-12 for v in values)
    steps = {round(b - a, 12) for a, b in zip(values, values[1:], strict=False)}
    assert len({f"{s:.6g}" for s in steps}) == 1  # evenly spaced
    step = next(iter(steps))
    assert f"{step / 10 ** math.floor(math.log10(step)):.6g}" in {"1", "2", "5"}
    labels = [f"{v:.{decimals}f}" for v in values]
    assert len(set(labels)) == len(labels)  # the labels tell the ticks apart
