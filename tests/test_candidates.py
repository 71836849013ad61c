"""The sampled-softmax masked-LM (`pretrain --mlm-candidates K`): the loss on a case computed here, its limit (every
word a candidate) equal to the full softmax, the sampler's draws and corrections, and a run: resume bitwise, two
processes equal one, the full-softmax evaluation, refused with ELECTRA."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import forked_ranks
from safetensors.torch import load_file

from bertforge.cli import main
from bertforge.config import BertConfig
from bertforge.files import read_jsonl
from bertforge.models import (
    CANDIDATES_MULTIPLE,
    HEAD_ROWS_MULTIPLE,
    IGNORE_INDEX,
    BertForPreTraining,
    masked_lm,
    sampled_masked_lm,
)
from bertforge.pretrain.objectives import CandidateSampler, PretrainingObjective

TINY = {"vocab_size": 2000, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 64}


def _head(vocab: int = 7, hidden: int = 4, seed: int = 0) -> BertForPreTraining:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=1,
                        intermediate_size=8, max_position_embeddings=16)
    model = BertForPreTraining(config)
    with torch.no_grad():
        model.cls.predictions.bias.normal_()  # a bias of zeros would hide a bias left out
    return model


def test_the_loss_equals_one_computed_by_hand():
    model = _head()
    head, emb = model.cls.predictions, model.bert.embeddings.word_embeddings
    seq = torch.randn(1, 3, 4)
    labels = torch.tensor([[2, IGNORE_INDEX, 5]])
    candidates = torch.tensor([0, 5, 6])
    log_inclusion = torch.log(torch.tensor([1.0, 0.9, 0.5, 0.4, 0.3, 0.2, 0.1]))
    logits, loss = sampled_masked_lm(head, emb, seq, labels, candidates, log_inclusion)
    with torch.no_grad():
        h = head.transform(seq[0])  # (3, H)
        w, b = emb.weight, head.bias
        total = 0.0
        for row, word in ((0, 2), (2, 5)):
            def score(j, row=row):
                return float(h[row] @ w[j] + b[j] - log_inclusion[j])
            others = [score(j) for j in candidates.tolist() if j != word]  # the own word is not its own negative
            own = score(word)
            total += -own + math.log(math.exp(own) + sum(math.exp(x) for x in others))
    assert loss.item() == pytest.approx(total / 2, rel=1e-5)
    assert logits.shape == (2, 4) and logits[1, 2] == float("-inf")  # position 2's word 5 is candidate 1


def test_with_every_word_a_sure_candidate_the_loss_is_the_full_softmax():
    model = _head(vocab=9)
    head, emb = model.cls.predictions, model.bert.embeddings.word_embeddings
    seq = torch.randn(2, 5, 4)
    labels = torch.tensor([[3, IGNORE_INDEX, 8, 0, IGNORE_INDEX], [IGNORE_INDEX, 1, 1, 7, 4]])
    _, full = masked_lm(head, emb, seq, labels)
    _, sampled = sampled_masked_lm(head, emb, seq, labels, torch.arange(9), torch.zeros(9))
    assert float(sampled) == pytest.approx(float(full), rel=1e-6)
    g_full = torch.autograd.grad(full, emb.weight)[0]
    g_sampled = torch.autograd.grad(sampled_masked_lm(head, emb, seq, labels, torch.arange(9), torch.zeros(9))[1],
                                    emb.weight)[0]
    torch.testing.assert_close(g_sampled, g_full)


def test_many_draws_approach_the_full_softmax_and_few_do_not():
    """With K draws every word is in the set nearly surely (its correction nearly 0): the loss nears the full one."""
    model = _head(vocab=50, hidden=8)
    head, emb = model.cls.predictions, model.bert.embeddings.word_embeddings
    seq = torch.randn(2, 6, 8)
    labels = torch.randint(5, 50, (2, 6))
    _, full = masked_lm(head, emb, seq, labels)
    special = np.zeros(50, bool)
    special[:5] = True
    counts = np.arange(50) * 10
    many = CandidateSampler(counts, 200_000, special, seed=0).sample({}, torch.device("cpu"))
    few = CandidateSampler(counts, 3, special, seed=0).sample({}, torch.device("cpu"))
    assert len(many[0]) == 50  # every word drawn, the specials added
    assert float(sampled_masked_lm(head, emb, seq, labels, *many)[1]) == pytest.approx(float(full), abs=1e-3)
    assert abs(float(sampled_masked_lm(head, emb, seq, labels, *few)[1]) - float(full)) > 1e-2


def test_the_sampler_draws_by_frequency_keeps_the_specials_and_corrects_by_the_chance_to_be_drawn():
    special = np.array([True, True, False, False, False, False])
    counts = np.array([0, 0, 999, 0, 9, 99])
    sampler = CandidateSampler(counts, 4, special, seed=1)
    q = np.array([0, 0, 1000, 1, 10, 100]) / 1111  # +1 each, the specials out
    expected = np.log(1 - (1 - q[2:]) ** 4)
    np.testing.assert_allclose(sampler.log_inclusion[2:].numpy(), expected, rtol=1e-5)
    assert sampler.log_inclusion[:2].tolist() == [0.0, 0.0]
    drawn = [sampler.sample({"instance": torch.tensor([[0, i]])}, torch.device("cpu"))[0] for i in range(400)]
    for c in drawn:
        assert c[:2].tolist() == [0, 1] and len(set(c.tolist())) == len(c)  # the specials, then unique words
    share = {w: np.mean([w in c.tolist() for c in drawn]) for w in (2, 3, 4, 5)}
    for w in (2, 3, 4, 5):
        assert share[w] == pytest.approx(1 - (1 - q[w]) ** 4, abs=0.06), w
    assert share[2] > share[5] > share[4] > share[3]


def test_the_draw_depends_on_the_step_not_on_the_process():
    special = np.zeros(500, bool)
    special[:3] = True
    sampler = CandidateSampler(np.ones(500), 40, special, seed=7)
    again = CandidateSampler(np.ones(500), 40, special, seed=7)
    at = {"instance": torch.tensor([[1, 17], [1, 3]])}
    torch.manual_seed(0)
    a = sampler.sample(at, torch.device("cpu"))[0]
    torch.manual_seed(1)
    assert torch.equal(a, again.sample(at, torch.device("cpu"))[0])
    assert not torch.equal(a, sampler.sample({"instance": torch.tensor([[1, 18]])}, torch.device("cpu"))[0])
    assert not torch.equal(a, CandidateSampler(np.ones(500), 40, special, seed=8).sample(at, torch.device("cpu"))[0])
    # one draw a step: the micro-batches of a step of 8 sequences (whichever process holds them) draw alike
    step = CandidateSampler(np.ones(500), 40, special, seed=7, batch_size=8)
    cpu = torch.device("cpu")
    first, same, later = (step.sample({"instance": torch.tensor([[0, i]])}, cpu)[0] for i in (16, 21, 24))
    assert torch.equal(first, same) and not torch.equal(first, later)


def test_the_objective_scores_its_masked_lm_on_the_drawn_words_and_leaves_the_rest_as_it_was():
    torch.manual_seed(0)
    config = BertConfig(**TINY)
    model = BertForPreTraining(config)
    model.eval()
    special = np.zeros(2000, bool)
    special[:5] = True
    ids = torch.randint(5, 2000, (2, 12))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 2:5] = ids[:, 2:5]
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
             "mlm_labels": labels, "nsp_labels": torch.zeros(2, dtype=torch.long), "instance": torch.tensor([[0, 4]])}
    full = PretrainingObjective(nsp=False, is_special=special).losses(model, batch)["mlm"]
    sampler = CandidateSampler(np.ones(2000), 30, special, seed=0)
    sampled = PretrainingObjective(nsp=False, is_special=special, candidates=sampler).losses(model, batch)["mlm"]
    assert float(sampled) < float(full)  # 30-odd words compete instead of 2,000
    sampled.backward()
    touched = model.bert.embeddings.word_embeddings.weight.grad.abs().sum(1) > 0
    cands = set(sampler.sample(batch, torch.device("cpu"))[0].tolist())
    words = set(ids.flatten().tolist())  # the inputs' embeddings get their gradient too
    assert set(torch.nonzero(touched).flatten().tolist()) <= cands | words


# --- a run ------------------------------------------------------------------------------------------------------


def _args(data: Path, out: Path, config: str, *extra: str) -> list[str]:
    return ["pretrain", "--data", str(data), "--model", config, "--out", str(out), "--mlm-candidates", "64",
            "--steps", "6", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "1", "--eval-batches", "2",
            "--eval-every", "3", "--save-every", "3", "--log-every", "1", "--no-progress", "--precision", "fp32",
            "--no-nsp", *extra]


@pytest.fixture(scope="module")
def run(prepared, tmp_path_factory) -> Path:
    """A run of 6 steps; its model config (dropout on: resume must restore the random numbers) beside it."""
    root = tmp_path_factory.mktemp("candidates")
    (root / "tiny.json").write_text(json.dumps(TINY))
    assert main(_args(prepared, root / "run", str(root / "tiny.json"))) == 0
    return root / "run"


def test_a_run_records_the_option_and_evaluates_on_the_whole_vocabulary(run):
    assert json.loads((run / "run_config.json").read_text())["mlm_candidates"] == 64
    rows = read_jsonl(run / "metrics.jsonl")
    train = [r for r in rows if "loss" in r and r.get("split") != "eval"]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert len(train) == 6 and evals
    # the evaluation scores the whole vocabulary: an untrained model's loss is near log(2,000); training's is over
    # the drawn words only, far below it
    assert evals[0]["mlm_loss"] == pytest.approx(math.log(2000), abs=0.3)
    assert train[0]["mlm_loss"] < math.log(2000) - 1


@pytest.mark.slow
def test_resume_after_an_interruption_is_bitwise_equal(run, prepared, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(run / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    shutil.copy(run / "run_config.json", cut / "run_config.json")
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(run / "metrics.jsonl")
                                               if r["step"] <= 3))
    assert main(_args(prepared, cut, str(run.parent / "tiny.json"), "--resume")) == 0
    a, b = load_file(run / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_processes_equal_one(prepared, tmp_path, one_thread):
    """Also the budget recipe's case in two ranks: without NSP the pooler and its head get no gradient."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}))
    args = _args(prepared, tmp_path / "one", str(cfg))[1:]
    assert main(["pretrain", *args]) == 0
    two = forked_ranks(["pretrain", *[str(tmp_path / "two") if a == str(tmp_path / "one") else a for a in args]],
                       tmp_path / "logs")
    assert two.returncode == 0, two.stderr[-3000:]
    la, lb = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("one", "two"))
    for x, y in zip(la, lb, strict=True):
        for key in ("loss", "mlm_loss", "mlm_accuracy"):
            if key in x:
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (x["step"], key)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)


def test_resuming_a_checkpoint_whose_optimizer_trained_other_weights_is_refused_in_one_line(run, prepared, tmp_path,
                                                                                             capsys):
    """A run without NSP started before the pooler was frozen holds optimizer state for the pooler too."""
    cut = tmp_path / "cut"
    shutil.copytree(run / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    shutil.copy(run / "run_config.json", cut / "run_config.json")
    state_file = cut / "checkpoints" / "step-3" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    group = state["optimizer"]["param_groups"][0]
    group["params"] = [*group["params"], max(p for g in state["optimizer"]["param_groups"] for p in g["params"]) + 1]
    torch.save(state, state_file)
    assert main(_args(prepared, cut, str(run.parent / "tiny.json"), "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optimizer state" in err and "--init" in err


def test_electra_refuses_it(prepared, tiny_config_file, tmp_path, capsys):
    assert main(_args(prepared, tmp_path / "run", tiny_config_file(), "--objective", "electra")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--mlm-candidates" in err and "electra" in err
    assert not (tmp_path / "run").exists()


def test_the_gradient_of_a_word_not_drawn_is_zero_in_the_decoder_bias():
    model = _head(vocab=12)
    head, emb = model.cls.predictions, model.bert.embeddings.word_embeddings
    labels = torch.tensor([[4, 6, IGNORE_INDEX]])
    _, loss = sampled_masked_lm(head, emb, torch.randn(1, 3, 4), labels, torch.tensor([0, 9]), torch.zeros(12))
    loss.backward()
    moved = set(torch.nonzero(head.bias.grad).flatten().tolist())
    assert moved == {0, 4, 6, 9}


def _unpadded_sampled_loss(head, emb, seq, labels, candidates, log_inclusion):
    """The sampled softmax's loss over exactly the labelled rows and the drawn columns, as it was written before the
    head's shapes were padded: the reference the padded one must equal."""
    selected = labels != IGNORE_INDEX
    hidden = head.transform(seq[selected])
    targets = labels[selected]
    w, b = emb.weight, head.bias
    own = (hidden * w[targets]).sum(-1) + b[targets] - log_inclusion[targets]
    others = torch.nn.functional.linear(hidden, w[candidates], b[candidates] - log_inclusion[candidates])
    others = others.masked_fill(candidates[None, :] == targets[:, None], float("-inf"))
    logits = torch.cat([own[:, None], others], 1)
    return torch.nn.functional.cross_entropy(logits, torch.zeros_like(targets))


def test_the_heads_products_take_few_shapes_whatever_a_steps_counts(monkeypatch):
    """Under bf16 on a CPU oneDNN builds a kernel for every new matrix shape, and a step's count of masked positions and
    of drawn words changes every step: the head's rows and the candidate columns come padded to multiples, and the
    loss, its gradient and the logits returned are those of the exact rows and columns."""
    model = _head(vocab=300, hidden=8, seed=3)
    head, emb = model.cls.predictions, model.bert.embeddings.word_embeddings
    rows, columns = set(), set()
    plain_linear = torch.nn.functional.linear

    def linear(x, weight, bias=None):  # the transform's square product gives the rows, the candidates' the columns
        (rows.add(x.shape[0]) if weight.shape[0] == x.shape[-1] else columns.add(weight.shape[0]))
        return plain_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    g = torch.Generator().manual_seed(0)
    log_inclusion = -torch.rand(300, generator=g)
    counts = set()
    for _ in range(25):
        seq = torch.randn(4, 20, 8, generator=g, requires_grad=True)
        labels = torch.where(torch.rand(4, 20, generator=g) < torch.rand((), generator=g),
                             torch.randint(5, 300, (4, 20), generator=g), IGNORE_INDEX)
        labels[0, 0] = 7  # at least one
        candidates = torch.unique(torch.randint(5, 300, (int(torch.randint(20, 200, (), generator=g)),), generator=g))
        logits, loss = sampled_masked_lm(head, emb, seq, labels, candidates, log_inclusion)
        with monkeypatch.context() as plain:
            plain.setattr(torch.nn.functional, "linear", plain_linear)
            reference = _unpadded_sampled_loss(head, emb, seq, labels, candidates, log_inclusion)
        count = int((labels != IGNORE_INDEX).sum())
        counts.add((count, candidates.numel()))
        assert logits.shape == (count, 1 + candidates.numel())
        assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
        grad, = torch.autograd.grad(loss, seq)
        grad_reference, = torch.autograd.grad(reference, seq)
        assert torch.allclose(grad, grad_reference, atol=1e-7)
    assert len(counts) > 20  # the counts changed nearly every step, and the shapes did not follow them
    assert all(r % HEAD_ROWS_MULTIPLE == 0 for r in rows) and len(rows) <= 3
    assert all(c % CANDIDATES_MULTIPLE == 0 for c in columns) and len(columns) <= 4


def test_the_full_softmax_heads_rows_come_padded_and_its_logits_exact():
    model = _head(vocab=50, hidden=8, seed=4)
    head, emb = model.cls.predictions, model.bert.embeddings.word_embeddings
    rows = []
    hook = head.transform.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    seq = torch.randn(3, 11, 8)
    labels = torch.full((3, 11), IGNORE_INDEX)
    labels[0, 2], labels[2, 5], labels[2, 9] = 4, 17, 30
    logits, loss = masked_lm(head, emb, seq, labels)
    hook.remove()
    with torch.no_grad():
        exact = head(seq[labels != IGNORE_INDEX], emb)  # (3, V), row-major order
    assert rows == [HEAD_ROWS_MULTIPLE] and logits.shape == (3, 50)
    assert torch.allclose(logits, exact, atol=1e-6)
    reference = torch.nn.functional.cross_entropy(exact, torch.tensor([4, 17, 30]))
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
