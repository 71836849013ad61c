"""`bertforge.finetune.compare`: two starting points, each choosing its lr on the first seeds by its own dev score,
the remaining seeds at that lr, means, spreads and the difference. The protocol on a scripted runner (what each run
scores is set by the test), then once end to end on a tiny model."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import torch
from test_finetune import config, init_dir, write_custom  # noqa: F401 (init_dir: a fixture)

from bertforge.errors import BertforgeError
from bertforge.finetune.compare import Run, Side, compare_sides

# dev score of (side, lr, seed number k); test = dev - 10
DEV = {("pretrained", 1e-3): [80, 70, 60, 50], ("pretrained", 1e-4): [75, 76, 90, 91],
       ("scratch", 1e-3): [60, 64, 62, 66], ("scratch", 1e-4): [64, 60, 0, 0]}


class Scripted:
    """A runner that scores each run by DEV and records the rounds it was handed."""

    def __init__(self):
        self.rounds: list[list[Run]] = []

    def __call__(self, runs: list[Run]) -> list[dict]:
        self.rounds.append(runs)
        return [{"seed": r.seed, "dev": DEV[r.side, r.lr][r.k], "test": DEV[r.side, r.lr][r.k] - 10} for r in runs]


def _sides(root: Path, **pretrained) -> list[Side]:
    return [Side("pretrained", False, lambda lr, k: root / f"pre-lr{lr:g}-seed{k}", **pretrained),
            Side("scratch", True, lambda lr, k: root / f"rnd-lr{lr:g}-seed{k}")]


def test_each_side_chooses_its_lr_on_the_first_seeds_and_runs_the_rest_at_it(tmp_path):
    runner = Scripted()
    template = config("data", "init", tmp_path / "unused", seed=100)
    both = compare_sides(template, _sides(tmp_path, options={"layer_lr_decay": 0.8}), lrs=(1e-3, 1e-4), seeds=4,
                         select_seeds=2, runner=runner)
    # pretrained: 1e-4's mean over seeds 0-1 (75.5) beats 1e-3's (75), though 1e-3 has the best single run (80)
    pre, rnd = both.sides["pretrained"], both.sides["scratch"]
    assert pre.grid_dev == {1e-3: 75, 1e-4: 75.5} and pre.lr == 1e-4
    assert rnd.grid_dev == {1e-3: 62, 1e-4: 62} and rnd.lr == 1e-3  # a tie: the first of the grid
    # round one: every side's grid on seeds 0-1; round two: the remaining seeds at each side's choice
    assert [(r.side, r.lr, r.k) for r in runner.rounds[0]] == [
        (s, lr, k) for s in ("pretrained", "scratch") for lr in (1e-3, 1e-4) for k in (0, 1)]
    assert [(r.side, r.lr, r.k) for r in runner.rounds[1]] == [("pretrained", 1e-4, 2), ("pretrained", 1e-4, 3),
                                                               ("scratch", 1e-3, 2), ("scratch", 1e-3, 3)]
    # each run's config: the template's, its own lr, seed, side and directory; the side's own options
    run = runner.rounds[1][0]
    assert run.config.out_dir == str(tmp_path / "pre-lr0.0001-seed2") and run.config.data_dir == "data"
    o = run.config.options
    assert (o.lr, o.seed, o.from_scratch, o.layer_lr_decay, o.batch_size) == (1e-4, 102, False, 0.8, 8)
    o = runner.rounds[1][2].config.options
    assert (o.lr, o.seed, o.from_scratch, o.layer_lr_decay) == (1e-3, 102, True, 1.0)
    # reported: the chosen lr's runs, every seed once, with their means and sample standard deviations
    assert [r["seed"] for r in pre.runs] == [100, 101, 102, 103]
    assert [r["dev"] for r in pre.runs] == [75, 76, 90, 91] and [r["dev"] for r in rnd.runs] == [60, 64, 62, 66]
    assert pre.stats["test_mean"] == statistics.mean([65, 66, 80, 81])
    assert pre.stats["test_std"] == pytest.approx(statistics.stdev([65, 66, 80, 81]))
    assert rnd.stats["dev_std"] == pytest.approx(statistics.stdev([60, 64, 62, 66]))
    assert both.split == "test" and both.difference == pytest.approx(73.0 - 53.0)


def test_one_lr_a_side_and_every_seed_in_the_first_round(tmp_path):
    runner = Scripted()
    both = compare_sides(config("data", "init", tmp_path / "o"), _sides(tmp_path, lrs=(1e-4,)), lrs=(1e-3,),
                         seeds=3, select_seeds=3, runner=runner)
    assert len(runner.rounds) == 1 and [(r.side, r.lr) for r in runner.rounds[0]] == \
        [("pretrained", 1e-4)] * 3 + [("scratch", 1e-3)] * 3
    assert both.sides["pretrained"].lr == 1e-4 and both.sides["scratch"].lr == 1e-3
    one = compare_sides(config("data", "init", tmp_path / "o"), _sides(tmp_path), lrs=(1e-3,), seeds=1,
                        select_seeds=1, runner=Scripted())
    assert one.sides["pretrained"].stats["test_std"] == 0.0  # one seed: no spread


@pytest.mark.parametrize("seeds, select, sides, message", [
    (2, 3, None, "select_seeds 3 must be between 1 and seeds (2)"),
    (2, 0, None, "select_seeds 0 must be between 1"),
    (2, 1, "one", "two sides of different names"),
])
def test_a_protocol_that_cannot_run_is_refused(tmp_path, seeds, select, sides, message):
    chosen = _sides(tmp_path)[:1] if sides == "one" else _sides(tmp_path)
    with pytest.raises(BertforgeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compare_sides(config("d", "i", tmp_path), chosen, lrs=(1e-3,), seeds=seeds, select_seeds=select,
                      runner=Scripted())


@pytest.mark.slow
def test_end_to_end_each_run_is_a_scored_finetuning_read_back_when_finished(init_dir, tmp_path):  # noqa: F811
    """Both sides of a tiny model on a keyword task: 2 lrs on seed 0, seed 1 at the choice; dev scores from the
    runs' own scores.json; a second call reads every run back."""
    data = write_custom("csv", tmp_path / "data")
    (data / "test.csv").write_text((data / "dev.csv").read_text())
    template = config(data, init_dir, tmp_path / "unused", seed=5)
    sides = [Side(n, n == "scratch", lambda lr, k, n=n: tmp_path / f"{n}-lr{lr:g}" / f"seed{k}")
             for n in ("pretrained", "scratch")]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        both = compare_sides(template, sides, lrs=(1e-3, 1e-5), seeds=2, select_seeds=1)
        again = compare_sides(template, sides, lrs=(1e-3, 1e-5), seeds=2, select_seeds=1)
    finally:
        torch.set_num_threads(before)
    assert again == both
    for name, side in both.sides.items():
        dev = {lr: json.loads((tmp_path / f"{name}-lr{lr:g}" / "seed0" / "scores.json").read_text())["dev"]
               ["accuracy"] for lr in (1e-3, 1e-5)}
        assert side.grid_dev == dev and side.lr == max((1e-3, 1e-5), key=dev.__getitem__)
        assert [r["seed"] for r in side.runs] == [5, 6] and side.runs[0]["dev"] == dev[side.lr]
        assert all(0 <= r["test"] <= 100 and r["lr"] == side.lr for r in side.runs)
        assert (tmp_path / f"{name}-lr{side.lr:g}" / "seed1" / "scores.json").is_file()
        # each scored run's test predictions beside its scores, which they reproduce
        with open(data / "test.csv", newline="") as f:
            gold = [row["stars"] for row in csv.DictReader(f)]
        predicted = json.loads((tmp_path / f"{name}-lr{side.lr:g}" / "seed1" / "predictions_test.json").read_text())
        assert len(predicted) == len(gold)
        right = sum(p == g for p, g in zip(predicted, gold, strict=True))
        assert side.runs[1]["test"] == pytest.approx(100 * right / len(gold))
        other = 1e-5 if side.lr == 1e-3 else 1e-3
        assert not (tmp_path / f"{name}-lr{other:g}" / "seed1").exists()
        recorded = json.loads((tmp_path / f"{name}-lr{side.lr:g}" / "seed1" / "run_config.json").read_text())
        assert recorded["options"]["from_scratch"] == (name == "scratch") and recorded["options"]["seed"] == 6
    assert both.difference == pytest.approx(both.sides["pretrained"].stats["test_mean"]
                                            - both.sides["scratch"].stats["test_mean"])
