"""The training loop and `bertforge pretrain`: loss falls, exact accumulation, exact resume after SIGKILL,
checkpoints on SIGTERM, NaN stops, bad configurations refused, and 2-process DDP equals 1 process."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from forked import Forked
from safetensors.torch import load_file
from support import pretrain_config

import bertforge.cpu
from bertforge import BertForPreTraining
from bertforge.cli import main
from bertforge.errors import BertforgeError
from bertforge.files import read_jsonl
from bertforge.options import DataOptions
from bertforge.pretrain.run import pretrain
from bertforge.train.loop import LoopOptions, resolve_precision
from bertforge.train.optim import parameter_groups, warmup_linear_decay
from bertforge.train.rundir import RUN_CONFIG

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)


def loop(**kw) -> LoopOptions:
    base = dict(steps=8, batch_size=8, lr=1e-3, warmup_steps=2, log_every=1, progress=False, seed=3)
    return LoopOptions(**{**base, **kw})


def tiny_model_config(tmp_path: Path, **overrides) -> str:
    config = {"vocab_size": 2000, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "max_position_embeddings": 64, **overrides}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    return str(path)


def without_isotropy(metrics: dict) -> set[str]:
    """The names of an evaluation's figures but the embeddings' isotropy (emb_*, tests/test_isotropy.py)."""
    return {k for k in metrics if not k.startswith("emb_")}


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model.safetensors")


@pytest.mark.slow  # several seconds: full pretraining runs or a server process
def test_tiny_pretraining_loss_falls_and_model_loads_here_and_in_transformers(prepared, tmp_path):
    out = tmp_path / "run"
    result = pretrain(pretrain_config(prepared, out, model="tiny",
                                      loop=loop(steps=30, batch_size=16, lr=2e-3, eval_every=15),
                                      data_options=DataOptions(eval_batches=4)))
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
    first = sum(r["loss"] for r in train[:5]) / 5
    last = sum(r["loss"] for r in train[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert all(abs(r["loss"] - r["mlm_loss"] - r["nsp_loss"]) < 1e-4 for r in train)
    assert without_isotropy(result.final_metrics) == {"mlm_accuracy", "mlm_loss", "mlm_perplexity", "nsp_accuracy"}
    assert (out / "training_curves.svg").stat().st_size > 1000
    assert {"vocab.txt", "tokenizer.json", "config.json", "model.safetensors", "run_config.json"} <= {
        p.name for p in out.iterdir()}
    ours = BertForPreTraining.from_pretrained(out)
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.BertForPreTraining.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(5, 2000, (2, 12))
    torch.testing.assert_close(ours.eval()(ids).nsp_logits, hf.eval()(input_ids=ids).seq_relationship_logits,
                               atol=1e-5, rtol=0)


@pytest.mark.slow  # several seconds: full pretraining runs or a server process
def test_gradient_accumulation_takes_the_same_step(prepared, tmp_path):
    cfg = tiny_model_config(tmp_path, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pretrain(pretrain_config(prepared, tmp_path / "whole", model=cfg, loop=loop(steps=3),
                             data_options=DataOptions(eval_batches=0)))
    pretrain(pretrain_config(prepared, tmp_path / "parts", model=cfg, loop=loop(steps=3, micro_batch_size=2),
                             data_options=DataOptions(eval_batches=0)))
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-6, rtol=1e-5, msg=k)
    la = [r["loss"] for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if r["split"] == "train"]
    lb = [r["loss"] for r in read_jsonl(tmp_path / "parts" / "metrics.jsonl") if r["split"] == "train"]
    assert la == pytest.approx(lb, abs=1e-5)


def test_a_pretraining_run_equals_a_plain_reference_loop(prepared, tmp_path):
    """`pretrain` (loop, loss weighting, parameter groups, schedule, clipping) ends where a textbook loop with
    transformers' BertForPreTraining and torch's AdamW ends, from the same weights on the same batches; the
    gradients' norm it logs each step is the norm torch's clip_grad_norm_ returns there."""
    transformers = pytest.importorskip("transformers")
    from bertforge.config import BertConfig
    from bertforge.data.loader import PretrainingData
    from bertforge.model_files import from_hf_state_dict

    config = BertConfig.from_dict(json.loads(Path(tiny_model_config(
        tmp_path, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).read_text()))
    torch.manual_seed(5)
    BertForPreTraining(config).save_pretrained(tmp_path / "init")
    steps, warmup, lr = 12, 3, 3e-3
    pretrain(pretrain_config(prepared, tmp_path / "ours", init=tmp_path / "init",
                             loop=loop(steps=steps, warmup_steps=warmup, lr=lr, clip_grad_norm=0.5),
                             data_options=DataOptions(eval_batches=0)))

    ref = transformers.BertForPreTraining.from_pretrained(tmp_path / "init").train()
    decay = [p for n, p in ref.named_parameters() if "LayerNorm" not in n and not n.endswith("bias")]
    no_decay = [p for n, p in ref.named_parameters() if "LayerNorm" in n or n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-6)
    batches = PretrainingData(prepared, "train", DataOptions()).batches(8)
    norms = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * (step / warmup if step < warmup else (steps - step) / (steps - warmup))
        b = next(batches)
        ref(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
            labels=b["mlm_labels"], next_sentence_label=b["nsp_labels"]).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()

    logged = [r["grad_norm"] for r in read_jsonl(tmp_path / "ours" / "metrics.jsonl") if r["split"] == "train"]
    assert logged == pytest.approx(norms, rel=1e-3)
    assert max(norms) > 0.5  # some steps were clipped
    expected = from_hf_state_dict(ref.state_dict(), with_bert_prefix=True)
    got = BertForPreTraining.from_pretrained(tmp_path / "ours", verbose=False).state_dict()
    initial = BertForPreTraining.from_pretrained(tmp_path / "init", verbose=False).state_dict()
    moved = 0
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], atol=2e-5, rtol=1e-4, msg=name)
        moved += not torch.equal(value, initial[name])
    assert moved > len(got) // 2  # the weights did change: the comparison is not between two initial states


@pytest.mark.slow  # several seconds: full pretraining runs or a server process
def test_bf16_autocast_trains_fp32_weights_close_to_an_fp32_run(prepared, tmp_path, monkeypatch):
    """--precision bf16 on the CPU: the matmuls run in bf16 (the weights end different from an fp32 run of the
    same seed), the stored weights and optimizer stay fp32, and the run follows the fp32 one closely. On a CPU
    without bf16 instructions (refused there for speed) the same numbers are computed, emulated."""
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: True)
    cfg = tiny_model_config(tmp_path, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    runs = {}
    for precision in ("fp32", "bf16"):
        pretrain(pretrain_config(prepared, tmp_path / precision, model=cfg, loop=loop(steps=20, precision=precision),
                                 data_options=DataOptions(eval_batches=0)))
        runs[precision] = [r["loss"] for r in read_jsonl(tmp_path / precision / "metrics.jsonl")
                           if r["split"] == "train"]
    assert json.loads((tmp_path / "bf16" / RUN_CONFIG).read_text())["loop"]["precision"] == "bf16"
    a, b = weights(tmp_path / "fp32"), weights(tmp_path / "bf16")
    assert all(v.dtype == torch.float32 for v in b.values())
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=0.02)
    assert sum(runs["bf16"][-3:]) < sum(runs["bf16"][:3]) - 0.5


def test_precision_is_resolved_per_device(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: True)
    assert [resolve_precision(p, cpu) for p in ("auto", "fp32", "bf16")] == ["fp32", "fp32", "bf16"]
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: False)
    assert [resolve_precision(p, cpu) for p in ("auto", "fp32")] == ["fp32", "fp32"]
    with pytest.raises(BertforgeError, match="^--precision bf16: this CPU has no bf16 dot products"):
        resolve_precision("bf16", cpu)
    # CUDA devices with and without native bf16: tests/test_cuda.py
    with pytest.raises(BertforgeError, match="unknown precision 'fp16'; choose one of auto, fp32, bf16"):
        resolve_precision("fp16", cpu)


def test_schedule_and_weight_decay_groups():
    f = warmup_linear_decay(10, 110)
    assert [f(0), f(5), f(10), f(60), f(110)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    model = BertForPreTraining(__import__("bertforge").BertConfig.from_preset("tiny", vocab_size=50))
    decay, no_decay = parameter_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith(("bias", "norm.weight", "LayerNorm.weight")) for p in no_decay["params"])
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_lamb_trains(prepared, tmp_path):
    out = tmp_path / "lamb"
    pretrain(pretrain_config(prepared, out, model=tiny_model_config(tmp_path),
                             loop=loop(steps=12, optimizer="lamb", lr=5e-3), data_options=DataOptions(eval_batches=0)))
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
    assert sum(losses[-3:]) < sum(losses[:3])


def test_bad_configurations_fail_before_training(prepared, tmp_path):
    with pytest.raises(BertforgeError, match="not divisible by micro-batch size 3"):
        pretrain(pretrain_config(prepared, tmp_path / "a", model="tiny", loop=loop(batch_size=8, micro_batch_size=3)))
    with pytest.raises(BertforgeError, match="exceeds the model's max_position_embeddings 32"):
        pretrain(pretrain_config(prepared, tmp_path / "b",
                                 model=tiny_model_config(tmp_path, max_position_embeddings=32), loop=loop()))
    with pytest.raises(BertforgeError, match="vocab_size 3000 but the data's tokenizer has 2000"):
        pretrain(pretrain_config(prepared, tmp_path / "c", model=tiny_model_config(tmp_path, vocab_size=3000),
                                 loop=loop()))
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_nan_loss_stops_and_keeps_the_last_checkpoint(prepared, tmp_path, monkeypatch):
    from bertforge.pretrain import run as pretrain_module

    out = tmp_path / "run"
    calls = {"n": 0}
    real = pretrain_module.PretrainingObjective.losses

    def poisoned(self, model, batch):
        calls["n"] += 1
        losses = real(self, model, batch)
        if calls["n"] > 5:
            losses["mlm"] = losses["mlm"] * float("nan")
        return losses

    monkeypatch.setattr(pretrain_module.PretrainingObjective, "losses", poisoned)
    with pytest.raises(BertforgeError, match=r"loss became nan at step 6; the last good checkpoint is .*step-4"):
        pretrain(pretrain_config(prepared, out, model=tiny_model_config(tmp_path), loop=loop(steps=10, save_every=2),
                                 data_options=DataOptions(eval_batches=0)))
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step-2", "step-4"]
    BertForPreTraining.from_pretrained(out / "checkpoints" / "step-4")  # intact


def _cli(args: list[str], log: Path) -> Forked:
    return Forked(args, log)  # one thread, as the module's fixture set it: the runs compare bitwise


def _pretrain_args(prepared: Path, out: Path, cfg: str, steps: int) -> list[str]:
    return ["pretrain", "--data", str(prepared), "--out", str(out), "--model", cfg, "--steps", str(steps),
            "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "2", "--save-every", "4", "--eval-batches", "0",
            "--log-every", "1"]


def _wait_for(path: Path, proc: Forked, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.output()
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.01)


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_identical(prepared, tmp_path, capsys):
    cfg = tiny_model_config(tmp_path)  # dropout on: the RNG state must be restored too
    steps = 40
    full = _cli(_pretrain_args(prepared, tmp_path / "full", cfg, steps), tmp_path / "full.log")
    killed_out = tmp_path / "killed"
    killed = _cli(_pretrain_args(prepared, killed_out, cfg, steps), tmp_path / "killed.log")
    _wait_for(killed_out / "checkpoints" / "step-8", killed)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL, killed.output()
    assert not (killed_out / "model.safetensors").exists()  # really killed part-way
    assert main(_pretrain_args(prepared, killed_out, cfg, steps) + ["--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert full.wait() == 0, full.output()
    a, b = weights(tmp_path / "full"), weights(killed_out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps_logged = [r["step"] for r in read_jsonl(killed_out / "metrics.jsonl") if r["split"] == "train"]
    assert steps_logged == list(range(1, steps + 1))


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits(prepared, tmp_path):
    out = tmp_path / "run"
    proc = _cli(_pretrain_args(prepared, out, tiny_model_config(tmp_path), 400), tmp_path / "run.log")
    _wait_for(out / "checkpoints" / "step-4", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130, proc.output()
    assert "continue with --resume" in proc.output()
    state = json.loads(max((out / "checkpoints").iterdir(), key=lambda p: int(p.name[5:])).joinpath(
        "state.json").read_text())
    assert state["step"] >= 4 and state["data_position"]["position"] > 0


def test_a_val_split_of_one_document_reports_no_nsp_accuracy(prepared, tmp_path, shared_data, capsys):
    """One validation document gives IsNext pairs only: an NSP accuracy on it would be meaningless."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted((shared_data / "corpus" / "sotu").glob("18*.txt"))[:4]:
        shutil.copy(f, corpus / f.name)
    for seed in range(50):  # the split is drawn per document: find a seed that leaves exactly one in val
        out = tmp_path / f"data{seed}"
        assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(prepared / "tokenizer"), "--out",
                     str(out), "--max-seq-len", "64", "--val-fraction", "0.3", "--seed", str(seed), "--workers",
                     "1", "--no-progress"]) == 0
        if json.loads((out / "manifest.json").read_text())["counts"]["val"]["documents"] == 1:
            break
    else:
        pytest.fail("no seed put exactly one document in val")
    assert "the val split has a single document" in capsys.readouterr().out
    result = pretrain(pretrain_config(out, tmp_path / "run", model=tiny_model_config(tmp_path),
                                      loop=loop(steps=2, warmup_steps=1), data_options=DataOptions(eval_batches=2)))
    assert without_isotropy(result.final_metrics) == {"mlm_accuracy", "mlm_loss", "mlm_perplexity"}
    assert "NSP accuracy is not reported" in capsys.readouterr().out


class _SlowData:
    """Batches of a regression that take `delay` seconds each to produce, as a loader that cannot keep up does."""

    def __init__(self, delay: float):
        self.delay = delay

    def batches(self, micro: int, position: dict | None = None):
        data, start = self, (position or {}).get("batch", 0)

        class _It:
            position = {"batch": start}

            def __iter__(self):
                return self

            def __next__(self):
                time.sleep(data.delay)
                self.position = {"batch": self.position["batch"] + 1}
                return {"x": torch.ones(micro, 4), "attention_mask": torch.ones(micro, 3, dtype=torch.long)}

        return _It()


class _Regression:
    def counts(self, batch: dict) -> dict[str, float]:
        return {"loss": float(len(batch["x"]))}

    def losses(self, model, batch: dict) -> dict[str, torch.Tensor]:
        return {"loss": model(batch["x"]).pow(2).mean()}


def test_metrics_say_how_long_each_step_waited_for_data(tmp_path):
    from bertforge.train.loop import Hooks, Trainer

    for delay in (0.0, 0.05):
        out = tmp_path / f"delay-{delay}"
        Trainer(torch.nn.Linear(4, 1), _SlowData(delay), _Regression(), loop(steps=4, batch_size=2, log_every=2,
                                                                             device="cpu"),
                out, hooks=Hooks(save_model=lambda m, path: path.mkdir(parents=True, exist_ok=True))).run()
        logged = [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]
        assert [r["step"] for r in logged] == [2, 4]
        for r in logged:
            if delay:  # one batch a step (no accumulation): at least its delay, and never more than the step
                assert delay <= r["data_wait_s"] <= r["step_time_s"], r
            else:
                assert 0 <= r["data_wait_s"] < 0.01, r
