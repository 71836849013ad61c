"""Stacking: a half-depth model's layers copied on top of themselves, and a pretraining run in two stages that
a user starts, resumes and is refused like any other."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from simulated_clock import simulated_clock

from bertforge.cli import main
from bertforge.config import BertConfig
from bertforge.errors import BertforgeError
from bertforge.files import read_jsonl
from bertforge.models import BertForPreTraining
from bertforge.pretrain.stacking import half_depth, stack_layers
from bertforge.train.rundir import RUN_CONFIG

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)


def _model(layers: int, pre_ln: bool) -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers,
                                         num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                                         pre_layer_norm=pre_ln))


@pytest.mark.parametrize("pre_ln", [False, True])
def test_stacking_copies_layer_i_into_layers_i_and_i_plus_depth_and_everything_else_as_is(pre_ln):
    shallow = _model(3, pre_ln)
    deep = stack_layers(shallow)
    assert deep.config.num_hidden_layers == 6 and deep.config.pre_layer_norm is pre_ln
    source = dict(shallow.named_parameters())
    for name, p in deep.named_parameters():
        if ".encoder.layer." in name:
            index = int(name.split(".encoder.layer.")[1].split(".")[0])
            original = name.replace(f".layer.{index}.", f".layer.{index % 3}.")
        else:
            original = name
        torch.testing.assert_close(p, source[original], rtol=0, atol=0, msg=name)
        assert p.data_ptr() != source[original].data_ptr()  # copies: training one leaves the other alone
    # each trained layer is kept, not one of them repeated
    layers = deep.bert.encoder.layer
    assert not torch.equal(layers[0].intermediate.weight, layers[1].intermediate.weight)


def test_the_stacked_model_computes_the_shallow_stack_applied_twice():
    shallow, ids = _model(2, True).eval(), torch.randint(5, 50, (2, 9))
    deep = stack_layers(shallow).eval()
    with torch.no_grad():
        x = shallow.bert.embeddings(ids)
        for layer in [*shallow.bert.encoder.layer, *shallow.bert.encoder.layer]:
            x = layer(x, None)
        expected = shallow.bert.encoder.final_norm(x)
        got = deep.bert(ids).sequence_output
    torch.testing.assert_close(got, expected)


def test_half_depth_refuses_an_odd_depth():
    assert half_depth(BertConfig(num_hidden_layers=4)).num_hidden_layers == 2
    with pytest.raises(BertforgeError, match="even number of layers"):
        half_depth(BertConfig(num_hidden_layers=3))


def _args(prepared, out, *extra):
    # tiny: 2 layers, 1 in the first stage (mini's 4 and 2 cost twice the time and check nothing more)
    return ["pretrain", "--data", str(prepared), "--out", str(out), "--model", "tiny", "--recipe", "budget",
            "--batch-size", "2", "--max-seq-len", "16", "--eval-batches", "1", "--eval-every", "5",
            "--log-every", "1", "--no-progress", *extra]


@pytest.mark.slow  # seconds of training: make test runs it, make test-fast does not
def test_a_stacked_run_pretrains_half_depth_then_the_full_model_from_it(prepared, tmp_path, capsys):
    out = tmp_path / "stacked"
    assert main(_args(prepared, out, "--steps", "20", "--stack-fraction", "0.6")) == 0
    first, second = out / "half-depth", out
    assert json.loads((first / "config.json").read_text())["num_hidden_layers"] == 1
    assert json.loads((second / "config.json").read_text())["num_hidden_layers"] == 2
    first_config = json.loads((first / RUN_CONFIG).read_text())
    second_config = json.loads((second / RUN_CONFIG).read_text())
    assert first_config["loop"]["steps"] == 12 and second_config["loop"]["steps"] == 8  # 60% / 40% of 20
    assert second_config["init"] == str(first)
    stack = {"fraction": 0.6, "minutes": None, "steps": 20, "length_fraction": 0.25, "mask_prob": None}
    assert first_config["stack"] == {**stack, "stage": "half depth"}
    assert second_config["stack"] == {**stack, "stage": "full depth"}
    assert first_config["data_options"]["masked_lm_prob"] == second_config["data_options"]["masked_lm_prob"] == 0.4
    # the budget recipe's first stage reads a quarter of the run's length, 8 tokens at least, with as many tokens
    # a step: 4 sequences of 8 against 2 of 16
    assert (first_config["max_seq_len"], first_config["loop"]["batch_size"]) == (8, 4)
    assert (second_config["max_seq_len"], second_config["loop"]["batch_size"]) == (16, 2)
    assert [r["step"] for r in read_jsonl(first / "metrics.jsonl") if r["split"] == "train"] == list(range(1, 13))
    assert [r["step"] for r in read_jsonl(second / "metrics.jsonl") if r["split"] == "train"] == list(range(1, 9))
    # The second stage starts from the first's layers, stacked: its model after 0 steps would be the stack.
    half = BertForPreTraining.from_pretrained(first, verbose=False)
    full = BertForPreTraining.from_pretrained(second, verbose=False)
    assert full.config.num_hidden_layers == 2 * half.config.num_hidden_layers
    assert "stacked pretraining took" in capsys.readouterr().out
    # --stack-fraction 0 is an ordinary run of the full model
    plain = tmp_path / "plain"
    assert main(_args(prepared, plain, "--steps", "4", "--stack-fraction", "0")) == 0
    assert not (plain / "half-depth").exists()
    assert json.loads((plain / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.slow  # several seconds: full pretraining runs or a server process
def test_the_short_first_stage_reads_shorter_sequences_with_the_same_tokens_a_step(prepared, tmp_path, capsys):
    out = tmp_path / "short"
    # (and masks another share of its positions: --stack-mask-prob)
    args = _args(prepared, out, "--steps", "6", "--stack-fraction", "0.5", "--max-seq-len", "32", "--mask-prob",
                 "0.2", "--stack-mask-prob", "0.6", "--batch-size", "4", "--stack-length-fraction", "0.25",
                 "--log-every", "1")
    assert main(args) == 0
    first = json.loads((out / "half-depth" / RUN_CONFIG).read_text())
    assert (first["max_seq_len"], first["loop"]["batch_size"]) == (8, 16)
    assert (first["stack"]["length_fraction"], first["data_options"]["masked_lm_prob"]) == (0.25, 0.6)
    full = json.loads((out / RUN_CONFIG).read_text())
    assert (full["max_seq_len"], full["loop"]["batch_size"], full["data_options"]["masked_lm_prob"]) == (32, 4, 0.2)
    assert main(args[:-4] + ["--stack-length-fraction", "0.5", "--resume"]) == 2
    assert "--stack-length-fraction 0.25 -> 0.5" in capsys.readouterr().err
    assert main(args[:-6] + ["--stack-mask-prob", "0.5", "--stack-length-fraction", "0.25", "--resume"]) == 2
    assert "--stack-mask-prob 0.6 -> 0.5" in capsys.readouterr().err
    # a share shorter than 8 tokens is trained at 8, the shortest instances are made for
    short = tmp_path / "shortest"
    args = _args(prepared, short, "--steps", "4", "--stack-fraction", "0.5", "--stack-length-fraction", "0.1")
    assert main(args) == 0
    first = json.loads((short / "half-depth" / RUN_CONFIG).read_text())
    assert (first["max_seq_len"], first["loop"]["batch_size"]) == (8, 4)


@pytest.mark.slow  # several seconds: full pretraining runs or a server process
def test_a_stacked_run_resumes_in_the_stage_it_was_stopped_in(prepared, tmp_path, capsys):
    out = tmp_path / "stacked"
    args = _args(prepared, out, "--steps", "10", "--stack-fraction", "0.5", "--save-every", "2")
    assert main(args) == 0
    first_metrics = (out / "half-depth" / "metrics.jsonl").read_text()
    final = read_jsonl(out / "metrics.jsonl")
    # Stopped in the second stage after its step-2 checkpoint: the first stage is kept, the second resumes.
    for path in (out / "checkpoints").iterdir():
        if path.name != "step-2":
            shutil.rmtree(path)
    (out / "model.safetensors").unlink()
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    printed = capsys.readouterr().out
    assert "reusing the half-depth stage" in printed and "resumed from" in printed
    assert (out / "half-depth" / "metrics.jsonl").read_text() == first_metrics
    again = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in again if r["split"] == "train"] == [1, 2, 3, 4, 5]
    train = [r for r in final if r["split"] == "train"]
    assert [r["mlm_loss"] for r in again if r["split"] == "train"] == pytest.approx([r["mlm_loss"] for r in train])


def test_stacked_runs_refuse_a_used_directory_an_odd_depth_and_init(prepared, tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert main(_args(prepared, used, "--steps", "4")) == 2
    assert "is not empty (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"]  # nothing started inside it
    odd = tmp_path / "odd.json"
    BertConfig.from_preset("mini", num_hidden_layers=3, vocab_size=2000).to_json(odd)
    args = _args(prepared, tmp_path / "x", "--steps", "4")
    args[args.index("tiny")] = str(odd)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "even number of layers (the model has 3)" in err and "--stack-fraction 0" in err
    assert not (tmp_path / "x").exists()
    assert main(_args(prepared, tmp_path / "y", "--steps", "4", "--stack-fraction", "0.5", "--init", str(used))) == 2
    assert "--stack-fraction" in capsys.readouterr().err


@pytest.mark.slow  # several seconds: full pretraining runs or a server process
def test_a_second_stage_with_no_time_left_still_ends_the_run_instead_of_refusing(prepared, tmp_path, capsys):
    """A budget whose full-depth stage leaves no time for a step (a slow or busy CPU): the run ends with a stacked
    model rather than an error after the half-depth stage has spent its share."""
    out = tmp_path / "short"
    with simulated_clock(0.4):  # the second stage's 2.4 s are gone in its own step timing (10 steps of 0.4 s)
        assert main(_args(prepared, out, "--minutes", "0.4", "--stack-fraction", "0.9")) == 0
    printed = capsys.readouterr().out
    assert "this stage continues a run, so it trains until the budget ends" in printed
    plan = json.loads((out / "budget_plan.json").read_text())
    assert plan["over_budget"] and not json.loads((out / "half-depth" / "budget_plan.json").read_text())["over_budget"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"][-1] >= 1


@pytest.mark.slow  # several seconds: full pretraining runs or a server process
def test_a_stacked_budget_splits_the_minutes_and_resumes_only_as_it_was_started(prepared, tmp_path, capsys):
    out = tmp_path / "budget"
    args = _args(prepared, out, "--minutes", "0.4")
    with simulated_clock(0.4):  # 24 seconds of 0.4-second steps (14 and 10 a stage), without waiting for them
        assert main(args) == 0
    printed = capsys.readouterr().out
    took = float(re.search(r"stacked pretraining took ([0-9.]+) min of a 0.4-minute budget", printed)[1])
    assert took <= 0.4  # the simulated evaluations and saves take no time: the steps end at the deadline
    plans = [json.loads((d / "budget_plan.json").read_text()) for d in (out / "half-depth", out)]
    assert [p["minutes"] for p in plans] == pytest.approx([0.24, 0.16])
    assert [json.loads((d / "config.json").read_text())["num_hidden_layers"] for d in (out / "half-depth", out)] \
        == [1, 2]
    assert main(args + ["--minutes", "1", "--resume"]) == 2
    assert "the time budget (--minutes): 0.4 -> 1.0" in capsys.readouterr().err
    assert main(args + ["--stack-fraction", "0", "--resume"]) == 2
    assert "was stacked" in capsys.readouterr().err
    plain = tmp_path / "plain"
    plain_args = _args(prepared, plain, "--steps", "4", "--save-every", "2", "--stack-fraction", "0")
    assert main(plain_args) == 0
    shutil.rmtree(plain / "checkpoints" / "step-4")
    (plain / "model.safetensors").unlink()
    capsys.readouterr()
    assert main(plain_args[:-2] + ["--resume"]) == 2  # the budget recipe's stacking on a run that did not stack
    assert "was not stacked: resume it with --stack-fraction 0" in capsys.readouterr().err
    assert not (plain / "half-depth").exists()


@pytest.mark.slow  # three short pretrainings
def test_an_untied_decoder_is_kept_through_both_stages_and_refused_with_electra(prepared, tmp_path, capsys):
    out = tmp_path / "untied"
    assert main(_args(prepared, out, "--steps", "6", "--stack-fraction", "0.5", "--no-tie-embeddings")) == 0
    for stage in (out / "half-depth", out):
        assert json.loads((stage / "config.json").read_text())["tie_word_embeddings"] is False
    half = BertForPreTraining.from_pretrained(out / "half-depth", verbose=False)
    full = BertForPreTraining.from_pretrained(out, verbose=False)
    # the second stage started from the first's decoder (copied by stacking) and trained it on
    assert full.cls.predictions.decoder is not None and not torch.equal(full.cls.predictions.decoder.weight,
                                                                         half.cls.predictions.decoder.weight)
    assert main(_args(prepared, tmp_path / "e", "--steps", "2", "--objective", "electra",
                      "--no-tie-embeddings")) == 2
    assert "--no-tie-embeddings is not available with --objective electra" in capsys.readouterr().err
