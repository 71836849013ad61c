"""Fine-tuning remedies for pretrained starts: layer-wise learning rates (`--layer-lr-decay`) and re-initialising
the top layers (`--reinit-layers`)."""

from __future__ import annotations

import json

import pytest
import torch
from test_finetune import config, init_dir, write_custom  # noqa: F401 (init_dir: a fixture)

from bertforge.config import BertConfig
from bertforge.errors import BertforgeError
from bertforge.finetune.run import _task_model, finetune
from bertforge.models import BertForSequenceClassification
from bertforge.options import FinetuneOptions
from bertforge.train import distributed
from bertforge.train.optim import build_optimizer, parameter_groups

TINY = dict(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32, num_labels=2)


def _lr_of(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    by_id = {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    return {name: by_id[id(p)] for name, p in model.named_parameters()}


def test_each_layer_down_learns_at_the_decay_times_the_rate_above_it():
    model = BertForSequenceClassification(BertConfig(**TINY))
    lrs = _lr_of(build_optimizer(model, lr=1e-3, weight_decay=0.01, layer_lr_decay=0.5), model)
    assert lrs["classifier.weight"] == (1e-3, 0.01) and lrs["bert.pooler.dense.bias"] == (1e-3, 0.0)
    assert lrs["bert.encoder.layer.2.attention.qkv.weight"] == (pytest.approx(1e-3 * 0.5), 0.01)
    assert lrs["bert.encoder.layer.1.output_norm.weight"] == (pytest.approx(1e-3 * 0.25), 0.0)
    assert lrs["bert.encoder.layer.0.intermediate.weight"] == (pytest.approx(1e-3 * 0.125), 0.01)
    assert lrs["bert.embeddings.word_embeddings.weight"] == (pytest.approx(1e-3 * 0.0625), 0.01)
    assert lrs["bert.embeddings.LayerNorm.bias"] == (pytest.approx(1e-3 * 0.0625), 0.0)


def test_without_decay_the_groups_are_the_two_of_bert():
    model = BertForSequenceClassification(BertConfig(**TINY))
    groups = parameter_groups(model, 0.01)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and all("lr" not in g for g in groups)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_the_schedule_scales_every_layer_alike():
    model = BertForSequenceClassification(BertConfig(**TINY))
    opt = build_optimizer(model, lr=1e-3, layer_lr_decay=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1)
    assert len({round(base, 12) for base in sched.base_lrs}) == 5  # the heads, 3 layers, the embeddings
    for group, base in zip(opt.param_groups, sched.base_lrs, strict=True):
        assert group["lr"] == pytest.approx(0.1 * base)


def _task(kind: str = "classification"):
    return type("Task", (), {"kind": kind, "num_labels": 2, "name": "csv"})()


def test_reinit_gives_the_top_layers_and_pooler_fresh_weights_and_keeps_the_rest(init_dir):  # noqa: F811
    d = distributed.setup("cpu")
    pretrained = _task_model(_task(), init_dir, ["a", "b"], FinetuneOptions(), d).state_dict()
    model = _task_model(_task(), init_dir, ["a", "b"], FinetuneOptions(reinit_layers=1), d)
    state = model.state_dict()
    top = len(model.bert.encoder.layer) - 1
    fresh = [k for k in state if not torch.equal(state[k], pretrained[k])]
    assert f"bert.encoder.layer.{top}.attention.qkv.weight" in fresh and "bert.pooler.dense.weight" in fresh
    assert all(k.startswith((f"bert.encoder.layer.{top}.", "bert.pooler.")) for k in fresh), fresh
    # initialised as a new model's: LayerNorm weights ones, matrices with the config's standard deviation
    norm = state[f"bert.encoder.layer.{top}.output_norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    std = float(state[f"bert.encoder.layer.{top}.intermediate.weight"].std())
    assert std == pytest.approx(model.config.initializer_range, rel=0.2)


def test_reinit_of_more_layers_than_the_model_has_is_refused_in_one_line(init_dir, tmp_path):  # noqa: F811
    data = write_custom("csv", tmp_path / "data")
    out = tmp_path / "run"
    with pytest.raises(BertforgeError) as refused:
        finetune(config(data, init_dir, out, reinit_layers=9))
    err = str(refused.value)
    assert len(err.splitlines()) == 1 and "--reinit-layers 9" in err and "at most" in err
    assert not out.exists()


def test_a_run_with_both_records_them_and_trains(init_dir, tmp_path):  # noqa: F811
    data = write_custom("csv", tmp_path / "data")
    out = tmp_path / "run"
    finetune(config(data, init_dir, out, reinit_layers=1, layer_lr_decay=0.8))
    options = json.loads((out / "run_config.json").read_text())["options"]
    assert options["reinit_layers"] == 1 and options["layer_lr_decay"] == 0.8
    assert json.loads((out / "metrics.json").read_text())
