"""Budget pretraining: single-segment instances, the masking cap, pre-LN, dropout off, recipes, and a run planned
against a time budget whose learning rate reaches zero at its last step."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from simulated_clock import simulated_clock

from bertforge import kernels
from bertforge.cli import main
from bertforge.config import BertConfig
from bertforge.data.instances import create_single_segment_instances
from bertforge.data.loader import PretrainingData, default_max_predictions
from bertforge.encoder import BertModel
from bertforge.errors import BertforgeError
from bertforge.files import read_jsonl
from bertforge.models import BertForPreTraining
from bertforge.options import DataOptions
from bertforge.pretrain import budget
from bertforge.pretrain.budget import BudgetPlan, Deadline, plan_steps
from bertforge.pretrain.config import parse_minutes
from bertforge.pretrain.recipe import BUDGET, recipe_config
from bertforge.pretrain.run import pretrain
from bertforge.train import distributed
from bertforge.train.checkpoints import checkpoints
from bertforge.train.loop import LoopOptions
from bertforge.train.optim import build_optimizer, build_scheduler, set_total_steps
from bertforge.train.rundir import RUN_CONFIG

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)


def _pretrain(recipe: str, data: Path, out: Path, **options) -> None:
    """A run of the tiny model through the library: `recipe_config` from the options given, by their command-line
    names, then `pretrain` (the command line's own mapping is test_cli's)."""
    pretrain(recipe_config(recipe, data=str(data), out=str(out), model="tiny", progress=False, **options))


def test_single_segment_instances_keep_every_token_in_order_and_fill_the_sequence():
    rng = np.random.default_rng(0)
    document = [np.arange(start, start + n) for start, n in ((0, 30), (100, 50), (200, 7), (300, 140), (500, 20))]
    instances = create_single_segment_instances(document, rng, max_seq_len=64, short_seq_prob=0.0)
    assert all(len(i.tokens_b) == 0 and not i.is_random_next for i in instances)
    np.testing.assert_array_equal(np.concatenate([i.tokens_a for i in instances]), np.concatenate(document))
    assert [len(i.tokens_a) for i in instances] == [62, 62, 62, 247 - 3 * 62]  # full pieces of 62, then the rest


def test_single_segment_short_targets_follow_short_seq_prob():
    document = [np.arange(i * 10, i * 10 + 10) for i in range(400)]
    lengths = [len(i.tokens_a) for i in create_single_segment_instances(document, np.random.default_rng(1),
                                                                        max_seq_len=128, short_seq_prob=0.5)]
    short = [n for n in lengths[:-1] if n != 126]
    # Half the pieces have a length uniform in [2, 126] (one in 125 of those is 126 by chance).
    assert abs(len(short) / (len(lengths) - 1) - 0.5) < 3 * (0.25 / (len(lengths) - 1)) ** 0.5
    assert abs(np.mean(short) - 64) < 3 * (125 ** 2 / 12 / len(short)) ** 0.5


def test_the_masking_cap_is_the_papers():
    # The paper: max_predictions_per_seq 20 at length 128 and 80 at 512 for 15% masking.
    assert default_max_predictions(128) == 20
    assert default_max_predictions(512) == 80
    assert default_max_predictions(128, 0.4) >= round(128 * 0.4)


def test_no_nsp_batches_are_single_segments_masked_at_the_given_rate(prepared):
    data = PretrainingData(prepared, "train", DataOptions(nsp=False, masked_lm_prob=0.4, short_seq_prob=0.0))
    batch = next(data.batches(64))
    ids, labels, types = batch["input_ids"], batch["mlm_labels"], batch["token_type_ids"]
    assert int(types.sum()) == 0 and int(batch["nsp_labels"].sum()) == 0
    lengths = batch["attention_mask"].sum(1)
    sep = data.sep_id
    for row, n in enumerate(lengths.tolist()):
        assert labels[row, n - 1] == -100  # the final [SEP] is never chosen
        original = torch.where(labels[row] != -100, labels[row], ids[row])[:n]
        assert int((original == sep).sum()) == 1 and original[n - 1] == sep
    chosen = int((labels != -100).sum())
    expected = sum(min(data.max_predictions, round(0.4 * n)) for n in lengths.tolist())
    assert chosen == expected
    assert float(lengths.float().mean()) > 0.9 * data.max_seq_len  # instances fill the sequence


def test_pre_ln_last_layer_positions_match_the_full_computation():
    config = BertConfig.from_preset("tiny", vocab_size=300, pre_layer_norm=True, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertModel(config).eval()
    ids = torch.randint(5, 300, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 15:] = 0
    full = model(ids, None, mask).sequence_output
    positions = torch.tensor([[0, 4, 9], [0, 1, 14], [0, 19, 2]])
    part = model(ids, None, mask, positions=positions).sequence_output
    torch.testing.assert_close(part, full.gather(1, positions[..., None].expand(-1, -1, full.shape[2])))
    post = BertModel(config.replace(pre_layer_norm=False)).eval()
    post.load_state_dict({k: v for k, v in model.state_dict().items() if "final_norm" not in k})
    assert not torch.allclose(post(ids, None, mask).sequence_output, full, atol=1e-3)


def test_set_dropout_turns_dropout_off_without_changing_the_saved_config(tmp_path):
    config = BertConfig.from_preset("tiny", vocab_size=300)
    model = BertForPreTraining(config).train()
    ids = torch.randint(5, 300, (2, 16))
    assert not torch.equal(model(ids).nsp_logits, model(ids).nsp_logits)  # dropout on
    model.set_dropout(0.0)
    torch.testing.assert_close(model(ids).nsp_logits, model(ids).nsp_logits, atol=0, rtol=0)
    model.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["hidden_dropout_prob"] == 0.1 and saved["attention_probs_dropout_prob"] == 0.1


def test_parse_minutes_and_plan_steps():
    assert parse_minutes("30") == 30 and parse_minutes("90s") == 1.5 and parse_minutes("1.5h") == 90
    for bad in ("0", "-3", "soon", "m"):
        with pytest.raises(BertforgeError):
            parse_minutes(bad)
    # 10 minutes, 5 s already spent, 0.5 s/step, 2 s per evaluation every 100 steps and once at the end.
    def seconds(n: int) -> float:
        return n * 0.5 + (n // 100 + 1) * 2.0 + 5.0

    steps = plan_steps(10, 0.5, 2.0, 100, 5.0)
    most = max(n for n in range(2000) if seconds(n) <= 600)
    assert seconds(steps) <= 600 and steps >= 0.99 * most
    with pytest.raises(BertforgeError, match="budget"):
        plan_steps(0.05, 1.0, 0.0, 0, 0.0)
    assert plan_steps(0.05, 1.0, 0.0, 0, 0.0, continuing=True) == 10  # a stage after one already paid for
    assert plan_steps(10, 0.5, 2.0, 100, 5.0, continuing=True) == steps



def test_deadline_moves_the_end_of_the_run_to_where_the_measured_steps_put_it():
    now = [10.0]  # a fake clock: 10 s of setup before the loop starts
    deadline = Deadline(1.0, origin=0.0, reserve=2.0, every=5, clock=lambda: now[0])
    deadline.begin(0)
    now[0] += 10 * 0.5  # ten steps of 0.5 s
    total = deadline.steps(10, distributed.Dist(device=torch.device("cpu")))
    assert total == 96 and 10 + total * 0.5 + 2 == 60  # setup + steps + reserve = the budget
    now[0] += 20 * 3.0  # the machine got much slower: the deadline has passed
    assert deadline.steps(30, distributed.Dist(device=torch.device("cpu"))) == 30 + 1  # past it: one more step
    # A resumed run: 30 s were spent up to its checkpoint at step 40, and 5 s on this process's setup.
    resumed = Deadline(1.0, origin=95.0, reserve=2.0, every=5, clock=lambda: now[0])
    now[0] = 100.0
    resumed.begin(40, spent_before=30.0)
    now[0] += 10 * 0.5
    assert resumed.steps(50, distributed.Dist(device=torch.device("cpu"))) == 50 + 36  # (60 - 35 - 5 - 2) / 0.5


def test_moving_the_end_of_the_schedule_keeps_it_linear_to_zero_at_the_new_end():
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, lr=1.0)
    scheduler = build_scheduler(optimizer, 10, 100)
    for _ in range(50):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(50 / 90)
    set_total_steps(scheduler, 10, 70)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([(70 - s) / 60 for s in range(50, 70)]) and scheduler.get_last_lr()[0] == 0
    assert all(g["lr"] == 0 for g in optimizer.param_groups)

def test_warmup_must_fit_the_run():
    with pytest.raises(BertforgeError, match="--warmup-steps"):
        LoopOptions(steps=100, batch_size=8, warmup_steps=100).accumulation(1)
    with pytest.raises(BertforgeError, match="--warmup-steps"):
        LoopOptions(steps=100, batch_size=8, warmup_steps=-5).accumulation(1)


@pytest.mark.slow
def test_default_warmup_is_one_percent_of_the_steps(prepared, tmp_path):
    out = tmp_path / "run"
    _pretrain("bert", prepared, out, steps=200, batch_size=2, max_seq_len=16, eval_batches=0, log_every=1)
    lrs = [r["lr"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(1e-4 / 2) and lrs[2] == pytest.approx(1e-4)  # 2 warmup steps
    assert lrs[-1] == pytest.approx(1e-4 / 198, rel=1e-6)  # then linear decay to zero at step 200
    config = json.loads((out / RUN_CONFIG).read_text())
    assert config["recipe"]["name"] == "bert" and config["loop"]["batch_size"] == 2


@pytest.mark.slow
def test_budget_recipe_run_is_planned_to_its_budget_and_decays_to_zero(prepared, tmp_path, capsys):
    # The one budget on the wall clock, end to end (6 seconds); the others run on a simulated clock
    # (tests/simulated_clock.py).
    out = tmp_path / "budget"  # one stage: a stacked budget's planning is tested in test_stacking.py
    given = {"batch_size": 2, "max_seq_len": 16, "mask_prob": 0.3, "eval_batches": 2, "log_every": 1,
             "stack_fraction": 0}
    _pretrain("budget", prepared, out, minutes=0.1, **given)
    plan = BudgetPlan(**json.loads((out / "budget_plan.json").read_text()))
    config = json.loads((out / RUN_CONFIG).read_text())
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    steps = len(train)  # the first plan, moved to where the steps' measured time puts the deadline
    assert plan.steps == config["loop"]["steps"] and train[-1]["planned_steps"] == steps == train[-1]["step"]
    assert config["loop"]["warmup_steps"] == round(0.06 * plan.steps)
    took = float(re.search(r"pretraining took ([0-9.]+) min of a 0.1-minute budget", capsys.readouterr().out)[1])
    assert took <= 0.1 + 0.15  # the final evaluation and saves are all that may run over
    assert config["recipe"]["name"] == "budget" and config["dropout"] == 0.0
    assert config["data_options"]["nsp"] is False and config["data_options"]["masked_lm_prob"] == 0.3  # flag wins
    assert config["model"]["pre_layer_norm"] is True and config["loop"]["betas"] == [0.9, 0.98]
    assert max(r["lr"] for r in train) == pytest.approx(BUDGET.lr, rel=0.05)
    warmup = config["loop"]["warmup_steps"]
    assert train[-1]["lr"] == pytest.approx(BUDGET.lr / (steps - warmup))  # the last before zero
    assert all("nsp_loss" not in r for r in train) and all("nsp_accuracy" not in r for r in records)
    assert config["bow_weight"] == config["recipe"]["bow_weight"] > 0  # the recipe's bag-of-words loss on [CLS]
    assert all(r["bow_loss"] > 0 and r["loss"] == pytest.approx(r["mlm_loss"] + r["bow_loss"]) for r in train)
    saved = json.loads((out / "config.json").read_text())
    assert saved["pre_layer_norm"] is True and saved["hidden_dropout_prob"] == 0.1
    # --resume keeps the plan: a finished run refuses to go on rather than planning a new schedule, and a new
    # budget is a change of schedule, refused with the difference named.
    with pytest.raises(BertforgeError, match=re.escape(f"is complete (checkpoint at step {steps} of {steps})")):
        _pretrain("budget", prepared, out, minutes=0.1, resume=True, **given)
    with pytest.raises(BertforgeError, match=re.escape("budget (--minutes): 0.1 -> 5.0")):
        _pretrain("budget", prepared, out, minutes=5, resume=True, **given)


@pytest.mark.slow  # seconds of training: make test runs it, make test-fast does not
def test_a_resumed_budget_run_keeps_its_re_planned_schedule_and_the_budget_it_spent(prepared, tmp_path, capsys):
    out = tmp_path / "budget"
    given = {"stack_fraction": 0, "minutes": 0.25, "batch_size": 2, "max_seq_len": 16, "eval_batches": 0,
             "log_every": 1, "save_every": 10, "keep_last": 1000}
    # 15 simulated seconds: 10 steps timed at 0.3 s each, then steps of 0.35 s, slower than timed, as on a loaded
    # machine: the deadline moves the end of the schedule earlier than the first plan (a few dozen steps: each
    # costs its real time too)
    with simulated_clock(0.35, timed_seconds_per_step=0.3) as clock:
        start = clock.now
        _pretrain("budget", prepared, out, **given)
        assert 15 - 0.35 < clock.now - start <= 15  # the last step ends at the deadline, not a step later
    first = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
    warmup = json.loads((out / RUN_CONFIG).read_text())["loop"]["warmup_steps"]
    # Killed after its first checkpoint past the warmup: the later ones and the final model never written.
    kept = next(step for step, _ in checkpoints(out) if step > warmup)
    for step, path in checkpoints(out):
        if step > kept:
            shutil.rmtree(path)
    (out / "model.safetensors").unlink()
    state = json.loads((out / "checkpoints" / f"step-{kept}" / "state.json").read_text())
    assert state["total_steps"] != json.loads((out / "budget_plan.json").read_text())["steps"]  # re-planned
    assert 0 < state["budget_spent_s"] < 15
    capsys.readouterr()
    with simulated_clock(0.35, timed_seconds_per_step=0.3):
        _pretrain("budget", prepared, out, resume=True, **given)
    assert "resumed from" in capsys.readouterr().out
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    assert train[:kept] == first[:kept] and train[-1]["planned_steps"] == len(train)
    # the first step after the checkpoint runs on the schedule the checkpoint recorded, not on the first plan
    total = state["total_steps"]
    assert train[kept]["lr"] == pytest.approx(BUDGET.lr * (total - kept) / (total - warmup))
    assert train[-1]["lr"] == pytest.approx(BUDGET.lr / (len(train) - warmup))


def test_a_budget_run_builds_the_cpu_kernels_before_its_clock_starts(prepared, tmp_path, monkeypatch):
    """A machine's first run builds dropout's CPU kernels (10-20 s) on their first use: not on the budget's clock,
    where it would pass for slow training steps and cut the planned steps."""
    seen = []
    real_available = kernels.available
    monkeypatch.setattr(kernels, "available", lambda: (seen.append("kernels"), real_available())[1])
    with simulated_clock(0.1) as clock:
        budget.clock = lambda: (seen.append("clock"), clock())[1]  # put back by simulated_clock
        _pretrain("budget", prepared, tmp_path / "run", stack_fraction=0, minutes=0.05, batch_size=2, max_seq_len=16,
                  eval_batches=0)
    assert seen[0] == "kernels" and "clock" in seen, seen[:5]


def test_bad_recipe_values_are_error_lines(prepared, tmp_path, capsys):
    base = ["pretrain", "--data", str(prepared), "--out", str(tmp_path / "x"), "--model", "tiny", "--no-progress"]
    for extra, needle in ((["--betas", "0.9"], "--betas"), (["--dropout", "1.5"], "--dropout"),
                          (["--minutes", "soon"], "--minutes"), (["--mask-prob", "0"], "masking rate"),
                          (["--steps", "10", "--warmup-steps", "10"], "--warmup-steps")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and needle in err and "Traceback" not in err


def test_pretrained_pre_ln_model_loads_with_its_architecture_and_says_transformers_cannot(prepared, tmp_path,
                                                                                          capsys):
    out = tmp_path / "preln"
    _pretrain("bert", prepared, out, pre_ln=True, steps=3, batch_size=4, eval_batches=0)
    model = BertForPreTraining.from_pretrained(Path(out))
    assert model.config.pre_layer_norm and model.bert.encoder.final_norm is not None
    capsys.readouterr()
    assert main(["model", "info", "--model", str(out)]) == 0
    assert "transformers: cannot load this model" in capsys.readouterr().out
    assert main(["model", "info", "--model", "mini"]) == 0
    assert "transformers: loads as BertModel" in capsys.readouterr().out


def test_bag_of_words_loss_is_the_cross_entropy_against_each_sequences_word_distribution():
    from bertforge.models import bag_of_words

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=40, max_position_embeddings=16)).eval()
    emb = model.bert.embeddings.word_embeddings
    cls = torch.randn(3, model.config.hidden_size)
    labels = torch.tensor([[5, 7, 5, -100], [9, -100, -100, -100], [-100, -100, -100, -100]])
    got = bag_of_words(model.cls.predictions, emb, cls, labels)
    log_probs = torch.log_softmax(model.cls.predictions(cls, emb), -1)
    # word distributions written out: 5 twice and 7 once in the first sequence, 9 alone in the second; the
    # third has no words and is left out of the mean
    first = -(2 / 3 * log_probs[0, 5] + 1 / 3 * log_probs[0, 7])
    second = -log_probs[1, 9]
    torch.testing.assert_close(got, (first + second) / 2)


def test_bag_of_words_labels_restore_masked_tokens_and_leave_out_special_tokens_and_padding():
    from bertforge.pretrain.objectives import PretrainingObjective

    is_special = np.zeros(20, bool)
    is_special[[0, 1, 2, 3, 4]] = True
    objective = PretrainingObjective(nsp=False, bow_weight=0.5, is_special=is_special)
    batch = {"input_ids": torch.tensor([[2, 4, 9, 17, 3, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
             "mlm_labels": torch.tensor([[-100, 8, -100, 6, -100, -100]])}
    assert objective.bow_labels(batch).tolist() == [[-100, 8, 9, 6, -100, -100]]
    assert objective.counts(batch) == {"mlm": 2, "bow": 1}
    with pytest.raises(ValueError, match="is_special"):
        PretrainingObjective(bow_weight=0.5)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_bag_of_words_reads_cls_whether_or_not_the_last_layer_runs_at_the_masked_positions_only(pre_ln):
    torch.manual_seed(2)
    config = BertConfig.from_preset("tiny", vocab_size=50, max_position_embeddings=32).replace(pre_layer_norm=pre_ln)
    model = BertForPreTraining(config).eval()
    ids = torch.randint(5, 50, (3, 12))
    ids[:, 0], ids[:, -1] = 2, 3
    mask = torch.ones_like(ids)
    mlm = torch.full_like(ids, -100)
    mlm[:, 4], mlm[1, 7] = ids[:, 4], ids[1, 7]
    bag = ids.masked_fill((ids == 2) | (ids == 3), -100)
    sparse = model(ids, None, mask, mlm_labels=mlm, bow_labels=bag)
    full = model(ids, None, mask, bow_labels=bag)
    torch.testing.assert_close(sparse.bow_loss, full.bow_loss)
    torch.testing.assert_close(sparse.loss, sparse.mlm_loss + sparse.bow_loss)
    # the loss trains the encoder below [CLS], not only the head
    sparse.bow_loss.backward()
    assert model.bert.encoder.layer[0].attention.qkv.weight.grad.abs().sum() > 0


def test_a_recipe_fills_what_is_not_given_and_a_given_option_wins():
    from bertforge.pretrain.recipe import STEPS_UNTIL_PLANNED

    given = {"steps": 500, "lr": 5e-4, "nsp": None, "pre_ln": False}
    c = recipe_config("budget", data="d", out="o", **given)
    assert (c.loop.lr, c.model.pre_layer_norm) == (5e-4, False)  # given, even when false
    assert (c.data.nsp, c.loop.batch_size, c.data.masked_lm_prob, c.loop.betas) == (False, 16, 0.4, (0.9, 0.98))
    assert c.model.embedding_init == "cooccurrence" and c.stacking.fraction == 0.6 and c.objective.bow_weight == 0.1
    assert recipe_config("bert", data="d", out="o", **given).model.embedding_init == "random"
    assert (c.loop.steps, c.loop.warmup_steps, c.budget.warmup_fraction) == (500, 30, None)  # 6% of 500
    assert c.budget.larger_batch is None  # a budget of steps keeps the recipe's batch
    budgeted = recipe_config("budget", data="d", out="o", minutes=10, **given)
    assert (budgeted.loop.steps, budgeted.budget.warmup_fraction) == (STEPS_UNTIL_PLANNED, 0.06)  # laid over the plan
    assert budgeted.budget.larger_batch is None  # the lr was given
    assert recipe_config("budget", data="d", out="o", minutes=10).budget.larger_batch == BUDGET.larger_batch
    assert recipe_config("budget", data="d", out="o", minutes=10, warmup_steps=7).budget.warmup_fraction is None
    with pytest.raises(BertforgeError, match="unknown recipe 'fast'"):
        recipe_config("fast", data="d", out="o", **given)


def test_a_recipe_leaves_out_what_a_run_cannot_have_and_refuses_it_given():
    """--init: no stacking or co-occurrence embeddings (there is no new model); ELECTRA: no NSP, stacking, bag of
    words or sampled softmax; each refused when given."""
    c = recipe_config("budget", data="d", out="o", steps=10, init="m")
    assert (c.stacking.fraction, c.model.embedding_init, c.budget.larger_batch) == (0.0, "random", None)
    e = recipe_config("budget", data="d", out="o", minutes=5, objective="electra")
    assert (e.data.nsp, e.stacking.fraction, e.objective.bow_weight, e.objective.mlm_candidates) == (False, 0, 0, 0)
    assert e.budget.larger_batch is None
    for given, message in (({"init": "m", "stack_fraction": 0.5}, "with --init there is none to build"),
                           ({"init": "m", "embedding_init": "cooccurrence"}, "drop one of them"),
                           ({"objective": "electra", "bow_weight": 0.1}, "--bow-weight is not available"),
                           ({"objective": "electra", "nsp": True}, "--nsp is not available"),
                           ({"objective": "electra", "init": "m"}, "--init is not available"),
                           ({"batchsize": 8}, "unknown pretraining option 'batchsize'; did you mean 'batch_size'"),
                           ({"minutes": float("inf")}, "at most a year"), ({"minutes": 1e9}, "at most a year"),
                           ({"betas": (0.9,)}, "give 2 values")):
        with pytest.raises(BertforgeError, match=message):
            recipe_config("budget", data="d", out="o", steps=10, **given)


@pytest.mark.slow  # short pretrainings
def test_the_library_applies_a_recipe_with_the_options_given_winning(prepared, tmp_path):
    from bertforge.pretrain.run import pretrain

    out = tmp_path / "run"
    pretrain(recipe_config("budget", data=prepared, out=out, model="tiny", steps=3, batch_size=2, progress=False,
                           eval_batches=0, max_seq_len=16, stack_fraction=0, dropout=0.05))
    config = json.loads((out / RUN_CONFIG).read_text())
    assert config["recipe"]["name"] == "budget" and config["stack"] is None
    assert (config["loop"]["lr"], config["loop"]["betas"], config["loop"]["batch_size"]) == (BUDGET.lr, [0.9, 0.98], 2)
    assert config["loop"]["warmup_steps"] == 1 and config["loop"]["steps"] == 3
    assert (config["data_options"]["nsp"], config["data_options"]["masked_lm_prob"]) == (False, 0.4)
    assert config["data_options"]["eval_batches"] == 0 and config["dropout"] == 0.05  # given: they win
    assert config["model"]["pre_layer_norm"] is True and config["bow_weight"] == 0.1
    with pytest.raises(BertforgeError, match="the run's length: steps, or a time budget"):
        pretrain(recipe_config("budget", data=prepared, out=tmp_path / "none", model="tiny"))


def test_the_options_name_every_recipe_and_no_other():
    """options.py names the recipes without importing train/ (it sits below it): the names must stay the
    recipes', or `--recipe` would offer one that does not exist or hide one that does."""
    from bertforge.options import RECIPE_NAMES
    from bertforge.pretrain.recipe import RECIPES

    assert tuple(RECIPES) == RECIPE_NAMES
