"""An SVG of a run's curves from its metrics.jsonl: training losses on the left, evaluation metrics on the right.

Written out as SVG text here rather than drawn by a plotting library: a few kilobytes of text take milliseconds
at the end of a run, where matplotlib took about a second (half of it its import) and was a dependency for this
one picture. Browsers, editors and Markdown viewers show SVG as they show PNG."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

from bertforge.files import atomic_path, read_jsonl

_TRAIN_KEYS = ("loss", "mlm_loss", "nsp_loss", "bow_loss", "rtd_loss")
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
WIDTH, HEIGHT = 1100, 400  # the picture, two panels side by side
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 34, 46  # each panel's margins around its plot area
Series = tuple[str, list[tuple[float, float]], bool]  # label, (step, value) points, markers at the points


def plot_metrics(metrics_path: str | Path, svg_path: str | Path, *, earlier: str | Path | None = None
                 ) -> Path | None:
    """Training losses on the left, evaluation metrics on the right. Returns the SVG's path, or None if the
    log is empty. `earlier` is the log of a run this one continues (a stacked run's half-depth stage): drawn
    first, this run's steps counted on from its last, with a dashed line where this run begins."""
    records, offset = [], 0
    if earlier is not None and Path(earlier).is_file():
        records = read_jsonl(earlier)
        offset = max((r.get("step", 0) for r in records), default=0)
    if Path(metrics_path).is_file():
        records += [{**r, "step": r.get("step", 0) + offset} for r in read_jsonl(metrics_path)]
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    if not train and not evals:
        return None
    losses: list[Series] = [(key, points, False) for key in _TRAIN_KEYS
                            if (points := [(r["step"], r[key]) for r in train if _number(r.get(key))])]
    keys = sorted({k for r in evals for k, v in r.items() if _number(v)
                   and k not in ("step", "time") and not k.endswith(("loss", "perplexity"))})
    metrics: list[Series] = [(key, [(r["step"], r[key]) for r in evals if _number(r.get(key))], True)
                             for key in keys]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             *_panel(0, "training", "training loss", losses, offset),
             *_panel(WIDTH // 2, "evaluation", "", metrics, offset), "</svg>\n"]
    svg_path = Path(svg_path)
    with atomic_path(svg_path) as tmp:
        tmp.write_text("\n".join(parts), encoding="utf-8")
    return svg_path


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Area:
    """A panel's plot area in pixels and the data ranges it shows: maps (step, value) to SVG coordinates."""

    def __init__(self, x0: float, series: list[Series], offset: int):
        self.left, self.right = x0 + LEFT, x0 + WIDTH // 2 - RIGHT
        self.top, self.bottom = TOP, HEIGHT - BOTTOM
        steps = [x for _, points, _ in series for x, _ in points] + ([offset] if offset else [])
        values = [y for _, points, _ in series for _, y in points if math.isfinite(y)]
        self.x = _padded(min(steps, default=0), max(steps, default=1), 0.02)
        self.y = _padded(min(values, default=0), max(values, default=1), 0.05)

    def px(self, x: float) -> float:
        return self.left + (x - self.x[0]) / (self.x[1] - self.x[0]) * (self.right - self.left)

    def py(self, y: float) -> float:
        return self.bottom - (y - self.y[0]) / (self.y[1] - self.y[0]) * (self.bottom - self.top)


def _padded(lo: float, hi: float, pad: float) -> tuple[float, float]:
    """[lo, hi] widened by `pad` of its span each side; a single value gets a span around it."""
    if hi <= lo:
        half = abs(lo) * 0.05 or 0.5
        return lo - half, hi + half
    span = hi - lo
    return lo - pad * span, hi + pad * span


def ticks(lo: float, hi: float, most: int = 7) -> tuple[list[float], int]:
    """Round values (1, 2 or 5 times a power of ten apart) within [lo, hi], at most `most` + 1 of them, and the
    decimals their labels need."""
    raw = (hi - lo) / most
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    values = [k * step for k in range(first, math.floor(hi / step + 1e-9) + 1)]
    return values, max(0, math.ceil(-math.log10(step) - 1e-9))


def _panel(x0: float, title: str, ylabel: str, series: list[Series], offset: int) -> list[str]:
    area = _Area(x0, series, offset)
    out = _axes(area, title, ylabel)
    if not series:
        out.append(f'<text x="{(area.left + area.right) / 2:.1f}" y="{(area.top + area.bottom) / 2:.1f}" '
                   f'text-anchor="middle" fill="#777">none logged</text>')
    if offset:
        x = area.px(offset)
        out.append(f'<line x1="{x:.1f}" y1="{area.top}" x2="{x:.1f}" y2="{area.bottom}" stroke="grey" '
                   f'stroke-dasharray="5,4"/>')
    pixels = [[[(area.px(x), area.py(y)) for x, y in piece] for piece in _finite_pieces(points)]
              for _, points, _ in series]  # each series' unbroken runs, in SVG coordinates
    for i, ((label, _, markers), pieces) in enumerate(zip(series, pixels, strict=True)):
        color = COLORS[i % len(COLORS)]
        for piece in pieces:
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in piece)
            out.append(f'<polyline class="series" data-label="{escape(label)}" fill="none" stroke="{color}" '
                       f'stroke-width="1.5" points="{coords}"/>')
            if markers:
                out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in piece]
    drawn = [point for pieces in pixels for piece in pieces for point in piece]
    return out + _legend(area, [label for label, _, _ in series], drawn)


def _finite_pieces(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """The runs of points between non-finite values (a NaN or infinite loss breaks the line there)."""
    pieces: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if math.isfinite(y):
            pieces[-1].append((x, y))
        elif pieces[-1]:
            pieces.append([])
    return [p for p in pieces if p]


def _axes(area: _Area, title: str, ylabel: str) -> list[str]:
    """The frame, grid lines and tick labels of both axes, the title and the axis labels."""
    out = [f'<rect x="{area.left}" y="{area.top}" width="{area.right - area.left}" '
           f'height="{area.bottom - area.top}" fill="none" stroke="#333"/>']
    xs, xdec = ticks(*area.x)
    for x in xs:
        px = area.px(x)
        out.append(f'<line x1="{px:.1f}" y1="{area.top}" x2="{px:.1f}" y2="{area.bottom}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{px:.1f}" y="{area.bottom + 15}" text-anchor="middle">{x:,.{xdec}f}</text>')
    ys, ydec = ticks(*area.y)
    for y in ys:
        py = area.py(y)
        out.append(f'<line x1="{area.left}" y1="{py:.1f}" x2="{area.right}" y2="{py:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{area.left - 5}" y="{py + 4:.1f}" text-anchor="end">{y:.{ydec}f}</text>')
    middle = (area.left + area.right) / 2
    out.append(f'<text x="{middle:.1f}" y="{area.top - 10}" text-anchor="middle" font-size="13">{title}</text>')
    out.append(f'<text x="{middle:.1f}" y="{area.bottom + 34}" text-anchor="middle">step</text>')
    if ylabel:
        ymid = (area.top + area.bottom) / 2
        out.append(f'<text x="{area.left - 48}" y="{ymid:.1f}" text-anchor="middle" '
                   f'transform="rotate(-90 {area.left - 48} {ymid:.1f})">{ylabel}</text>')
    return out


def _legend(area: _Area, labels: list[str], inside: list[tuple[float, float]]) -> list[str]:
    """A box with a line of each series' colour and its name, in the plot area's corner that hides the fewest of
    the drawn points `inside` (top right when they tie)."""
    if not labels:
        return []
    width, height = 34 + 7 * max(map(len, labels)), 8 + 16 * len(labels)
    corners = [(area.right - width - 8, area.top + 8), (area.left + 8, area.top + 8),
               (area.right - width - 8, area.bottom - height - 8), (area.left + 8, area.bottom - height - 8)]
    x, y = min(corners, key=lambda c: sum(c[0] <= px <= c[0] + width and c[1] <= py <= c[1] + height
                                          for px, py in inside))
    out = [f'<rect x="{x:.1f}" y="{y:.1f}" width="{width}" height="{height}" fill="white" fill-opacity="0.85" '
           f'stroke="#ccc"/>']
    for i, label in enumerate(labels):
        row = y + 14 + 16 * i
        out.append(f'<line x1="{x + 6:.1f}" y1="{row - 4:.1f}" x2="{x + 26:.1f}" y2="{row - 4:.1f}" '
                   f'stroke="{COLORS[i % len(COLORS)]}" stroke-width="2"/>')
        out.append(f'<text class="legend" x="{x + 30:.1f}" y="{row:.1f}">{escape(label)}</text>')
    return out
