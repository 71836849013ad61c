"""A PNG of a run's curves from its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from bertforge.files import atomic_path, read_jsonl

_TRAIN_KEYS = ("loss", "mlm_loss", "nsp_loss", "bow_loss", "rtd_loss")


def plot_metrics(metrics_path: str | Path, png_path: str | Path, *, earlier: str | Path | None = None
                 ) -> Path | None:
    """Training losses on the left, evaluation metrics on the right. Returns the PNG path, or None if the
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
    from matplotlib.figure import Figure  # here: half a second to import, for a plot at the end of a run

    fig = Figure(figsize=(11, 4))  # not pyplot: no global backend or figure registry is touched
    left, right = fig.subplots(1, 2)
    for key in _TRAIN_KEYS:
        points = [(r["step"], r[key]) for r in train if key in r]
        if points:
            left.plot(*zip(*points, strict=True), label=key)
    left.set_xlabel("step")
    left.set_ylabel("training loss")
    left.set_title("training")
    left.legend()
    left.grid(alpha=0.3)
    keys = sorted({k for r in evals for k, v in r.items() if isinstance(v, (int, float))
                   and k not in ("step", "time") and not k.endswith(("loss", "perplexity"))})
    for key in keys:
        points = [(r["step"], r[key]) for r in evals if key in r]
        right.plot(*zip(*points, strict=True), marker="o", label=key)
    right.set_xlabel("step")
    right.set_title("evaluation")
    if keys:
        right.legend()
    right.grid(alpha=0.3)
    if offset:
        for ax in (left, right):
            ax.axvline(offset, color="grey", linestyle="--", linewidth=1)
    fig.tight_layout()
    png_path = Path(png_path)
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return png_path
