"""ELECTRA (`pretrain --objective electra`): sampling and labels, the tied embeddings, the loss on a case computed
here, the run directory (the discriminator loading in transformers, fill-mask from the generator, fine-tuning from
it), resume bitwise, and two processes equal to one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from forked import forked_ranks
from safetensors.torch import load_file

from bertforge.cli import main
from bertforge.config import BertConfig
from bertforge.electra import (
    GENERATOR_DIR,
    HEAD_FILE,
    ElectraForPreTraining,
    ElectraGenerator,
    corrupt,
    generator_config,
    sample_tokens,
)
from bertforge.encoder import BertModel
from bertforge.files import read_jsonl
from bertforge.models import BertForSequenceClassification
from bertforge.options import ElectraOptions
from bertforge.pretrain.electra import ElectraObjective, build_electra, position_uniforms

TINY = {"vocab_size": 2000, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 64}


def _tiny(**overrides) -> BertConfig:
    return BertConfig(**{**TINY, **overrides})


# --- sampling and labels ------------------------------------------------------------------------------------


def test_samples_invert_the_cumulative_distribution():
    probs = torch.tensor([0.2, 0.3, 0.5])
    logits = probs.log().expand(6, 3)
    uniforms = torch.tensor([0.05, 0.19, 0.21, 0.49, 0.51, 0.99])
    assert sample_tokens(logits, uniforms).tolist() == [0, 0, 1, 1, 2, 2]
    # a peaked distribution always gives its token
    peaked = torch.full((4, 10), -1e4)
    peaked[:, 7] = 0
    assert sample_tokens(peaked, torch.tensor([1e-6, 0.3, 0.7, 1 - 1e-6])).tolist() == [7] * 4


def test_sampled_frequencies_follow_the_softmax():
    n = 20000
    probs = torch.tensor([0.1, 0.6, 0.3])
    u = position_uniforms(7, torch.tensor([[0, i] for i in range(n // 10)]), 10).flatten()
    drawn = torch.bincount(sample_tokens(probs.log().expand(n, 3), u), minlength=3).double() / n
    for p, f in zip(probs.tolist(), drawn.tolist(), strict=True):
        assert abs(f - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_labels_mark_replaced_tokens_but_not_originals_or_samples_equal_to_them():
    mask = 4
    original = torch.tensor([[1, 10, 11, 12, 2, 0], [1, 20, 21, 22, 23, 2]])
    inputs = torch.tensor([[1, mask, 11, mask, 2, 0], [1, 20, mask, 99, 23, 2]])  # 99: the 10% random token
    labels = torch.full_like(original, -100)
    for row, col in ((0, 1), (0, 3), (1, 2), (1, 3)):
        labels[row, col] = original[row, col]
    sampled = torch.tensor([10, 50, 60, 22])  # row-major: (0,1) equals the original, (1,3) too
    corrupted, replaced = corrupt(inputs, labels, sampled)
    assert corrupted.tolist() == [[1, 10, 11, 50, 2, 0], [1, 20, 60, 22, 23, 2]]
    assert replaced.tolist() == [[False, False, False, True, False, False], [False, False, True, False, False, False]]


def test_uniforms_depend_on_the_instance_not_on_the_batch_it_is_in():
    instances = torch.tensor([[0, 3], [0, 4], [1, 3], [2, 17]])
    u = position_uniforms(12345, instances, 16)
    assert u.shape == (4, 16) and u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(position_uniforms(12345, instances[[2, 0]], 16), u[[2, 0]])  # another batch, same rows
    assert torch.equal(position_uniforms(12345, instances, 8), u[:, :8])
    assert len({tuple(r) for r in u.tolist()}) == 4  # each instance its own
    assert not torch.equal(position_uniforms(1, instances, 16), u)  # and each seed


# --- the model: tying, sizes, the loss --------------------------------------------------------------------------


def test_the_generator_and_discriminator_share_one_embedding_module():
    torch.manual_seed(0)
    model = build_electra(_tiny(), ElectraOptions(generator_width=0.5, generator_layers=0.5))
    gen, disc = model.generator.bert.embeddings, model.discriminator.embeddings
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm"):
        for a, b in zip(getattr(gen, name).parameters(), getattr(disc, name).parameters(), strict=True):
            assert a is b and a.data_ptr() == b.data_ptr(), name
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    assert sum(p is disc.word_embeddings.weight for p in model.parameters()) == 1  # optimised once
    # both models' gradients reach the one tensor
    ids = torch.randint(5, 2000, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    out = model(ids, None, torch.ones_like(ids), mlm_labels=labels, uniforms=torch.full(ids.shape, 0.5))
    out.mlm_loss.backward(retain_graph=True)
    from_generator = disc.word_embeddings.weight.grad.clone()
    assert from_generator.abs().sum() > 0
    out.rtd_loss.backward()
    assert not torch.equal(disc.word_embeddings.weight.grad, from_generator)
    g = model.generator.config
    assert (g.hidden_size, g.num_hidden_layers, g.intermediate_size, g.extra["embedding_size"]) == (16, 1, 64, 32)
    assert model.generator.bert.embeddings_project.weight.shape == (16, 32)


def test_a_generator_as_wide_as_the_discriminator_is_a_bert_masked_lm():
    g = generator_config(_tiny(), 1.0, 1.0)
    assert g.hidden_size == 32 and "embedding_size" not in g.extra
    from bertforge.models import BertForMaskedLM

    torch.manual_seed(0)
    ours = ElectraGenerator(g).state_dict()
    torch.manual_seed(0)
    bert = BertForMaskedLM(g).state_dict()
    assert ours.keys() == bert.keys() and all(ours[k].shape == bert[k].shape for k in ours)


def test_the_loss_equals_one_computed_by_hand():
    torch.manual_seed(0)
    model = build_electra(_tiny(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                          ElectraOptions(discriminator_weight=50.0)).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43, 2], [1, 50, 51, 2, 0, 0]])
    attention = (ids != 0).long()
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[0, 4], labels[1, 1] = 41, 43, 50
    inputs = ids.clone()
    inputs[0, 2] = inputs[0, 4] = inputs[1, 1] = 4  # [MASK]
    batch = {"input_ids": inputs, "token_type_ids": torch.zeros_like(ids), "attention_mask": attention,
             "mlm_labels": labels, "instance": torch.tensor([[0, 5], [0, 6]])}
    objective = ElectraObjective(50.0, seed=3)
    with torch.no_grad():
        losses = objective.losses(model, batch)
        # the generator: its logits at the three masked positions, a softmax written out
        logits = model.generator(inputs, batch["token_type_ids"], attention, labels=labels).logits.double()
        log_probs = logits - logits.exp().sum(-1, keepdim=True).log()
        mlm = -(log_probs[0, 41] + log_probs[1, 43] + log_probs[2, 50]) / 3
        # the samples, by walking each cumulative distribution to its uniform
        u = position_uniforms(3, batch["instance"], 6)[[0, 0, 1], [2, 4, 1]]
        sampled = []
        for row, target in zip(log_probs.exp(), u.tolist(), strict=True):
            total, k = 0.0, 0
            while total + row[k] < target * row.sum():
                total, k = total + float(row[k]), k + 1
            sampled.append(k)
        corrupted = ids.clone()
        corrupted[0, 2], corrupted[0, 4], corrupted[1, 1] = sampled
        replaced = (corrupted != ids).double()
        disc = model.head(model.discriminator(corrupted, None, attention).sequence_output).double()
        per_token = torch.log1p(torch.exp(-disc)) * replaced + torch.log1p(torch.exp(disc)) * (1 - replaced)
        rtd = (per_token * attention).sum() / attention.sum()  # 10 real tokens
    assert float(losses["mlm"]) == pytest.approx(float(mlm), rel=1e-5)
    assert float(losses["rtd"]) == pytest.approx(50 * float(rtd), rel=1e-5)
    assert objective.counts(batch) == {"mlm": 3, "rtd": 10}


# --- a run: its directory, transformers, fill-mask, fine-tuning --------------------------------------------------


def _args(data: Path, out: Path, config: str, *extra: str) -> list[str]:
    return ["pretrain", "--data", str(data), "--model", config, "--out", str(out), "--objective", "electra",
            "--steps", "6", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "1", "--eval-batches", "2",
            "--eval-every", "3", "--save-every", "3", "--log-every", "1", "--no-progress", "--precision", "fp32",
            "--generator-width", "0.5", *extra]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("electra_config") / "tiny.json"
    path.write_text(json.dumps(TINY))  # dropout on: resume must restore every rank's random numbers
    return str(path)


@pytest.fixture(scope="module")
def run(prepared, config_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("electra") / "run"
    assert main(_args(prepared, out, config_file)) == 0
    return out


def test_the_run_directory_holds_the_discriminator_its_head_and_the_generator(run):
    assert {"config.json", "model.safetensors", "vocab.txt", HEAD_FILE, GENERATOR_DIR} <= {p.name for p in
                                                                                             run.iterdir()}
    assert json.loads((run / "config.json").read_text())["architectures"] == ["BertModel"]
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json"} <= {
        p.name for p in (run / GENERATOR_DIR).iterdir()}
    assert set(load_file(run / HEAD_FILE)) == {"dense.weight", "dense.bias", "prediction.weight", "prediction.bias"}
    # the generator's copy of the shared embeddings is the discriminator's
    disc, gen = load_file(run / "model.safetensors"), load_file(run / GENERATOR_DIR / "model.safetensors")
    for name in ("word_embeddings.weight", "position_embeddings.weight", "LayerNorm.weight"):
        assert torch.equal(disc[f"embeddings.{name}"], gen[f"bert.embeddings.{name}"])
    records = read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    assert len(train) == 6 and all(r["loss"] == pytest.approx(r["mlm_loss"] + r["rtd_loss"]) for r in train)
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    for key in ("mlm_accuracy", "disc_accuracy", "replaced_precision", "replaced_recall", "replaced_share"):
        assert all(0 <= r[key] <= 1 for r in evals), key
    assert all(r["mlm_loss"] > 0 and r["disc_loss"] > 0 for r in evals)
    assert json.loads((run / "run_config.json").read_text())["data_options"]["nsp"] is False


def test_the_discriminator_loads_in_transformers_with_the_same_outputs(run):
    transformers = pytest.importorskip("transformers")
    ours = BertModel.from_pretrained(run, verbose=False).eval()
    theirs = transformers.BertModel.from_pretrained(run, add_pooling_layer=False).eval()
    ids = torch.tensor([[1, 40, 41, 42, 2, 0], [1, 50, 51, 52, 53, 2]])
    mask = (ids != 0).long()
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).sequence_output
        b = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(a * mask[..., None], b * mask[..., None], atol=1e-5, rtol=1e-4)


def test_fill_mask_on_the_run_directory_uses_the_generator(run, capsys):
    from bertforge.infer import MaskFiller

    text = "the state of the [MASK] is good"
    assert main(["fill-mask", "--model", str(run), text, "--json", "--top-k", "3"]) == 0
    out, err = capsys.readouterr()
    assert "ELECTRA" in err and str(run / GENERATOR_DIR) in err
    from_run = json.loads(out.splitlines()[-1])["masks"]
    assert from_run == MaskFiller(run / GENERATOR_DIR).fill([text], top_k=3)[0]
    # the generator as trained: its weights are what the run saved
    gen = ElectraGenerator.from_pretrained(run / GENERATOR_DIR, verbose=False)
    saved = load_file(run / GENERATOR_DIR / "model.safetensors")
    assert torch.equal(gen.bert.embeddings_project.weight, saved["bert.embeddings_project.weight"])


def test_fine_tuning_starts_from_the_discriminator(run):
    model = BertForSequenceClassification.from_pretrained(run, verbose=False)
    disc = load_file(run / "model.safetensors")
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, disc["embeddings.word_embeddings.weight"])
    assert torch.equal(model.bert.encoder.layer[1].output.weight, disc["encoder.layer.1.output.dense.weight"])


def test_electra_refuses_next_sentence_prediction(prepared, config_file, tmp_path, capsys):
    assert main(_args(prepared, tmp_path / "run", config_file, "--nsp")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--nsp" in err and "electra" in err
    assert not (tmp_path / "run").exists()


def test_resuming_with_the_other_objective_is_refused_and_leaves_the_checkpoints(run, prepared, config_file,
                                                                                  tmp_path, capsys):
    cut = tmp_path / "cut"
    shutil.copytree(run / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    shutil.copy(run / "run_config.json", cut / "run_config.json")
    mlm = [a for a in _args(prepared, cut, config_file, "--resume") if a not in ("--objective", "electra")]
    assert main(mlm) == 2
    assert "trained with --objective electra" in capsys.readouterr().err
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["step-3"]  # nothing set aside


@pytest.mark.slow
def test_resume_after_an_interruption_is_bitwise_equal(run, prepared, config_file, tmp_path):
    """What a run killed after its step-3 checkpoint leaves, resumed: the same three weight files, the same log."""
    cut = tmp_path / "cut"
    shutil.copytree(run / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    shutil.copy(run / "run_config.json", cut / "run_config.json")
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(run / "metrics.jsonl")
                                               if r["step"] <= 3))
    assert main(_args(prepared, cut, config_file, "--resume")) == 0
    for name in ("model.safetensors", HEAD_FILE, f"{GENERATOR_DIR}/model.safetensors"):
        a, b = load_file(run / name), load_file(cut / name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    clock = ("time", "tokens_per_s", "step_time_s", "data_wait_s")
    la, lb = ([{k: v for k, v in r.items() if k not in clock} for r in read_jsonl(d / "metrics.jsonl")]
              for d in (run, cut))
    assert la == lb


@pytest.mark.slow
def test_two_processes_equal_one(prepared, tmp_path, one_thread):
    """The same run in one process (this one, on one thread as each rank) and in two ranks (gloo, CPU): the same
    samples for the same instances, so the same losses and weights up to float summation order."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}))
    args = _args(prepared, tmp_path / "one", str(cfg))[1:]
    assert main(["pretrain", *args]) == 0
    two_args = [str(tmp_path / "two") if a == str(tmp_path / "one") else a for a in args]
    two = forked_ranks(["pretrain", *two_args], tmp_path / "logs")
    assert two.returncode == 0, two.stderr[-3000:]
    la, lb = ([r for r in read_jsonl(tmp_path / d / "metrics.jsonl")] for d in ("one", "two"))
    for x, y in zip(la, lb, strict=True):
        for key in ("loss", "mlm_loss", "rtd_loss", "disc_loss", "disc_accuracy", "replaced_recall"):
            if key in x:
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (x["step"], key)
    for name in ("model.safetensors", HEAD_FILE, f"{GENERATOR_DIR}/model.safetensors"):
        a, b = load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=f"{name} {k}")


def test_electra_model_rejects_a_generator_of_other_embeddings():
    with pytest.raises(ValueError, match="generator_config"):
        ElectraForPreTraining(_tiny(), _tiny(hidden_size=16, num_attention_heads=1, intermediate_size=64))


@pytest.mark.slow
def test_a_time_budget_plans_and_ends_the_run(prepared, config_file, tmp_path, capsys):
    """`--minutes` on the simulated clock (tests/simulated_clock.py): the steps are timed and planned with the
    generator in the step, and the run ends at the plan with its directory complete."""
    from simulated_clock import simulated_clock

    args = [a for a in _args(prepared, tmp_path / "run", config_file) if a not in ("--steps", "6")]
    with simulated_clock(0.25):  # 6 seconds of quarter-second steps
        assert main([*args, "--minutes", "0.1", "--eval-every", "0"]) == 0
    plan = json.loads((tmp_path / "run" / "budget_plan.json").read_text())
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"]
    assert plan["steps"] >= 10 and steps[-1] >= 10
    assert (tmp_path / "run" / GENERATOR_DIR / "model.safetensors").is_file()
    assert "a 0.1-minute budget" in capsys.readouterr().out


def test_the_losses_under_bf16_autocast_follow_fp32():
    """The step's forward pass as the loop runs it under `--precision bf16` (autocast; torch emulates bf16 where the
    CPU lacks it): the samples, labels and losses are computed in fp32 from bf16 logits, and gradients flow."""
    torch.manual_seed(0)
    model = build_electra(_tiny(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), ElectraOptions())
    ids = torch.randint(5, 2000, (4, 16))
    labels = torch.full_like(ids, -100)
    labels[:, 2:5] = ids[:, 2:5]
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
             "mlm_labels": labels, "instance": torch.stack([torch.zeros(4, dtype=torch.long), torch.arange(4)], 1)}
    objective = ElectraObjective(50.0, seed=0)
    fp32 = objective.losses(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = objective.losses(model, batch)
    for name in ("mlm", "rtd"):
        assert bf16[name].dtype == torch.float32
        assert float(bf16[name].detach()) == pytest.approx(float(fp32[name].detach()), rel=0.05), name
    (bf16["mlm"] + bf16["rtd"]).backward()
    assert model.generator.bert.embeddings_project.weight.grad is not None
    assert model.head.prediction.weight.grad is not None


@pytest.mark.slow  # torch.compile takes seconds
def test_compiled_electra_matches_eager(prepared, tmp_path, monkeypatch):
    """`--compile` compiles both encoders (the generator's and the discriminator's) and ends where eager ends.
    What is ELECTRA's own is tested here: two encoders of different widths compiled in one process, each traced
    and guarded by TorchDynamo (graphs for both widths, for training and evaluation), run by its eager backend.
    AOTAutograd and inductor's code generation run on the same encoder in tests/test_compile.py; here they took
    22 s (AOTAutograd, of a 34-s test on a 2-core Zen 3) and 99 s (inductor) for these graphs."""
    from torch._dynamo.utils import counters

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, **{**kw, "backend": "eager"}))

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}))
    losses = {}
    torch._dynamo.reset()
    counters.clear()
    for name, extra in (("eager", ()), ("compiled", ("--compile",))):
        assert main(_args(prepared, tmp_path / name, str(cfg), *extra)) == 0
        losses[name] = [r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["split"] == "train"]
        if name == "eager":
            assert not counters["stats"]
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # one encoder each, at least
    assert max(abs(a - b) for a, b in zip(losses["compiled"], losses["eager"], strict=True)) < 1e-3, losses
