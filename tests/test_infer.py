"""Inference: fill-mask, embeddings, task predictions, length-grouped batching and int8, from Python and the CLI.

Models are tiny and random (H 32, 2 layers) with an inline vocabulary, so every expected value is computed
here by hand, one text at a time and unpadded.
"""

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

import bertforge.cpu
import bertforge.infer.engines
import bertforge.infer.transforms
import bertforge.kernels
import bertforge.tasks.runner
from bertforge import BertConfig, BertforgeError, BertForMaskedLM, BertModel
from bertforge.cli import main
from bertforge.commands.inputs import read_input_records
from bertforge.heads import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification
from bertforge.infer import Encoder, Int8Linear, MaskFiller, Predictor, predict_records, quantize_int8
from bertforge.infer.transforms import _has_onednn_ops
from bertforge.tokenizer import Tokenizer

WORDS = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "that", "film", "movie", "good", "bad", "great",
         "awful", "plot", "acting", "story", "quick", "brown", "fox", "dog", "jumps", "over", "lazy", "john",
         "smith", "paris", "lives", "works", "where", "does", "who", "what", ",", ".", "?", "!", "'s"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
TEXTS = ["the film was good .", "bad", "the quick brown fox jumps over the lazy dog , and the dog was lazy .",
         "john smith lives in paris", "", "what a great movie ! the acting , the plot , the story", "awful acting"]
MASKED = ["the [MASK] was good .", "[MASK]", "the quick [MASK] fox jumps over the [MASK] dog , and [MASK] .",
          "a [MASK] movie", "john [MASK] lives in paris and works in the [MASK] of the film"]


def tiny_config(**kw) -> BertConfig:
    return BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, **kw)


def save(model, tokenizer, path, task: dict | None = None):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if task is not None:
        (path / "task.json").write_text(json.dumps(task))
    return path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(VOCAB, lowercase=True)


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_config())
    with torch.no_grad():  # a random head is nearly uniform; sharpen it so the top-k order means something
        model.cls.predictions.bias.normal_(0, 3)
    return save(model, tokenizer, tmp_path_factory.mktemp("mlm"))


@pytest.fixture(scope="module")
def clf_dir(tmp_path_factory, tokenizer):
    """A classification model directory as `bertforge finetune --task csv` writes it."""
    torch.manual_seed(1)
    labels = ["negative", "positive"]
    model = BertForSequenceClassification(tiny_config(num_labels=2, id2label=dict(enumerate(labels)), task="csv"))
    spec = {"task": "csv", "kind": "classification", "options": {}, "labels": labels, "max_length": 32}
    return save(model, tokenizer, tmp_path_factory.mktemp("clf"), spec)


def unpadded_states(model: BertModel, tokenizer: Tokenizer, text: str) -> torch.Tensor:
    ids = torch.tensor([tokenizer.encode(text).ids])
    with torch.no_grad():
        return model(ids).sequence_output[0]  # (T, H), no mask, no padding


# --- fill-mask -----------------------------------------------------------------------------------------


def test_fill_mask_top1_is_the_token_the_head_favours(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_config())
    with torch.no_grad():
        model.cls.predictions.bias[tokenizer.token_to_id("fox")] = 50.0
    filler = MaskFiller(save(model, tokenizer, tmp_path))
    masks = filler.fill("the quick brown [MASK] jumps", top_k=3)
    assert len(masks) == 1 and masks[0][0]["token"] == "fox" and masks[0][0]["score"] > 0.99


def test_fill_mask_matches_the_dense_head_one_text_at_a_time_in_mask_order(mlm_dir, tokenizer):
    filler = MaskFiller(mlm_dir)
    batched = filler.fill(MASKED, top_k=4, max_tokens=40)  # small budget: several batches, padding in each
    model = BertForMaskedLM.from_pretrained(mlm_dir, verbose=False).eval()
    for text, got in zip(MASKED, batched, strict=True):
        ids = tokenizer.encode(text).ids
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0].softmax(-1)  # (T, V): the head on every position
        positions = [i for i, t in enumerate(ids) if t == tokenizer.mask_id]
        assert len(got) == len(positions) == text.count("[MASK]")
        for pos, candidates in zip(positions, got, strict=True):
            p, top = probs[pos].topk(4)
            assert [c["token"] for c in candidates] == [tokenizer.id_to_token(int(t)) for t in top]
            np.testing.assert_allclose([c["score"] for c in candidates], p.numpy(), atol=1e-5)
            scores = [c["score"] for c in candidates]
            assert scores == sorted(scores, reverse=True) and sum(scores) <= 1 + 1e-6


def test_fill_mask_refuses_text_without_mask_and_model_without_head(mlm_dir, clf_dir, capsys):
    with pytest.raises(BertforgeError, match="no \\[MASK\\] token"):
        MaskFiller(mlm_dir).fill(["a [MASK] film", "no mask here"])
    with pytest.raises(BertforgeError, match="top-k"):
        MaskFiller(mlm_dir).fill("a [MASK] film", top_k=0)
    assert main(["fill-mask", "--model", str(mlm_dir), "no mask here"]) == 2
    assert main(["fill-mask", "--model", str(clf_dir), "a [MASK] film"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("error: no [MASK]") and "has no masked-LM head" in err[1]


def test_fill_mask_cli_table_json_input_file_and_int8(mlm_dir, tmp_path, capsys):
    expected = MaskFiller(mlm_dir).fill(MASKED[:3], top_k=2)
    (tmp_path / "in.txt").write_text(MASKED[1] + "\n\n" + MASKED[2] + "\n")
    assert main(["fill-mask", "--model", str(mlm_dir), MASKED[0], "--input", str(tmp_path / "in.txt"),
                 "--top-k", "2", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in lines] == MASKED[:3] and [r["masks"] for r in lines] == expected
    assert main(["fill-mask", "--model", str(mlm_dir), MASKED[0], "--top-k", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == MASKED[0] and out[1].startswith(f"  [MASK] 1: {expected[0][0][0]['token']} ")
    assert main(["fill-mask", "--model", str(mlm_dir), MASKED[0], "--quantize", "int8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["masks"][0][0]["token"] == expected[0][0][0]["token"]


# --- embeddings ----------------------------------------------------------------------------------------


def test_embed_cls_and_mean_pooling_equal_unpadded_one_at_a_time(mlm_dir, tokenizer):
    encoder = Encoder(mlm_dir)
    model = BertModel.from_pretrained(mlm_dir, verbose=False).eval()
    cls_vecs = encoder.embed(TEXTS, pooling="cls", max_tokens=48)  # several batches of mixed lengths
    mean_vecs = encoder.embed(TEXTS, pooling="mean", max_tokens=48)
    assert cls_vecs.shape == (len(TEXTS), 32) and cls_vecs.dtype == np.float32
    for i, text in enumerate(TEXTS):
        states = unpadded_states(model, tokenizer, text)
        np.testing.assert_allclose(cls_vecs[i], states[0].numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(mean_vecs[i], states.mean(0).numpy(), atol=1e-5, rtol=0)
    unit = encoder.embed(TEXTS, pooling="mean", normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(unit, mean_vecs / np.linalg.norm(mean_vecs, axis=1, keepdims=True), atol=1e-6)
    assert encoder.embed([]).shape == (0, 32)


def test_embed_pooler_only_when_the_model_has_one(mlm_dir, clf_dir, tokenizer):
    with pytest.raises(BertforgeError, match="no pooler weights"):
        Encoder(mlm_dir).embed(TEXTS, pooling="pooler")  # a masked-LM model: never a random pooler
    pooled = Encoder(clf_dir).embed(TEXTS[:2], pooling="pooler")
    model = BertModel.from_pretrained(clf_dir, verbose=False).eval()
    with torch.no_grad():
        expected = model(torch.tensor([tokenizer.encode(TEXTS[0]).ids])).pooled_output[0]
    np.testing.assert_allclose(pooled[0], expected.numpy(), atol=1e-5, rtol=0)


def test_embed_cli_writes_npy_and_jsonl(mlm_dir, tmp_path, capsys):
    expected = Encoder(mlm_dir).embed(TEXTS[:4], pooling="mean", normalize=True)
    records = [{"text": t, "id": i} for i, t in enumerate(TEXTS[2:4])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = ["embed", "--model", str(mlm_dir), "--text", *TEXTS[:2], "--input", str(tmp_path / "in.jsonl"),
              "--pooling", "mean", "--normalize"]
    assert main([*common, "--out", str(tmp_path / "v.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), expected, atol=1e-6)
    assert main([*common, "--out", str(tmp_path / "v.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == TEXTS[:4]
    np.testing.assert_allclose([r["embedding"] for r in rows], expected, atol=1e-6)  # rounded to 6 decimals
    capsys.readouterr()
    assert main(["embed", "--model", str(mlm_dir), "--text", "x", "--out", str(tmp_path / "v.txt")]) == 2
    assert capsys.readouterr().err.startswith("error: --out")


# --- int8 ----------------------------------------------------------------------------------------------


def test_int8_stays_close_to_fp32(mlm_dir):
    fp32 = Encoder(mlm_dir).embed(TEXTS, pooling="mean")
    int8 = Encoder(mlm_dir, quantize="int8").embed(TEXTS, pooling="mean")
    assert isinstance(Encoder(mlm_dir, quantize="int8").model.encoder.layer[0].intermediate,
                      (Int8Linear, torch.ao.nn.quantized.dynamic.Linear))
    # Seen on this tiny random model: max abs difference 8e-4 on vectors of std 0.66, cosine 0.9999999; top-1
    # probabilities within 1.2e-3, same top-1 tokens. (On fine-tuned MiniLM: bench/inference.py.)
    cosine = (fp32 * int8).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(int8, axis=1)
    assert cosine.min() > 0.9999 and np.abs(fp32 - int8).max() < 0.01
    a = MaskFiller(mlm_dir).fill(MASKED, top_k=1)
    b = MaskFiller(mlm_dir, quantize="int8").fill(MASKED, top_k=1)
    assert np.abs(np.array([m[0]["score"] for t in a for m in t]) - [m[0]["score"] for t in b for m in t]).max() < 0.01
    with pytest.raises(BertforgeError, match="CPU only"):
        Encoder(mlm_dir, quantize="int8", device="cuda")
    with pytest.raises(BertforgeError, match="only int8"):
        Encoder(mlm_dir, quantize="int4")


@pytest.mark.skipif(not bertforge.cpu.has_native_bf16(), reason="this CPU has no bf16 dot products")
def test_fill_mask_in_bf16_keeps_the_top_tokens(mlm_dir):
    """The masked-LM head in bf16 too (the tolerances are derived on real text in test_infer_fast.py): the same
    top-1 token wherever fp32 puts it clearly first, and top scores within 16 bf16 roundings (16 x 2^-8 of
    themselves) of fp32's."""
    fp32 = [m for t in MaskFiller(mlm_dir).fill(MASKED, top_k=2) for m in t]
    bf16 = [m for t in MaskFiller(mlm_dir, precision="bf16").fill(MASKED, top_k=2) for m in t]
    for a, b in zip(fp32, bf16, strict=True):
        if a[0]["score"] > 1.5 * a[1]["score"]:
            assert a[0]["token"] == b[0]["token"]
        assert abs(a[0]["score"] - b[0]["score"]) < 16 * 2 ** -8 * a[0]["score"]


def _activation_codes(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """The u8 codes (float64), scale and zero point Int8Linear gives activations `x`, worked out here on their own:
    per tensor, the range [min(x, 0), max(x, 0)] in 255 steps, each value rounded to its nearest step, the zero
    point added, within [0, 255]."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / 255 or 1.0  # all zeros: any scale
    zero = round(-lo / scale)
    return (torch.round(x.double() / scale) + zero).clamp(0, 255), scale, zero


@pytest.mark.parametrize("one_pass", [True, False])
def test_int8_activation_codes(one_pass, monkeypatch):
    """Both ways of quantizing activations (torch's one-pass quantizer, and the passes used without it) give the
    codes worked out by hand, a code off by one at most where the value sits on a rounding boundary, and the
    range's ends at codes 0 and 255."""
    monkeypatch.setattr(bertforge.infer.transforms, "_one_pass_quantizer", lambda: one_pass)
    torch.manual_seed(0)
    for x in (torch.randn(64, 37, 48) * 3 - 1, torch.rand(300, 20) + 2, -torch.rand(10, 9), torch.zeros(4, 5)):
        expected, scale, zero = _activation_codes(x)
        codes = bertforge.infer.transforms._u8_codes(x, scale, zero)
        assert codes.dtype == torch.uint8 and codes.shape == x.shape
        off = (codes.double() - expected).abs()
        assert off.max() <= 1 and (off > 0).double().mean() < 1e-3
        assert x.min() >= 0 or codes.min() == 0  # a negative minimum is the range's lower end
        assert x.max() <= 0 or codes.max() == 255  # a positive maximum its upper end


def test_int8_weight_bits_follow_the_cpu(monkeypatch):
    """8-bit weights where the CPU sums int8 products into int32, 7-bit on AVX2 alone, torch's fbgemm layers
    where neither is known; 8-bit weights halve the weight rounding of 7 bits."""
    native = bertforge.cpu.int8_weight_bits()
    torch.manual_seed(0)
    layer = nn.Linear(512, 64)
    x = torch.randn(16, 512)

    def quantized(bits: int | None) -> nn.Module:
        monkeypatch.setattr(bertforge.cpu, "int8_weight_bits", lambda: bits)
        return quantize_int8(nn.Sequential(copy.deepcopy(layer)))[0]

    assert isinstance(quantized(None), torch.ao.nn.quantized.dynamic.Linear)
    if not _has_onednn_ops():
        return
    for bits in (7, 8):
        q = quantized(bits)
        assert isinstance(q, Int8Linear)
        # the packed weight is opaque: its scale says how many codes the largest weight of each row was cut to
        np.testing.assert_allclose(q.weight_scale, layer.weight.detach().abs().amax(1) / (2 ** (bits - 1) - 1),
                                   rtol=1e-6)
    if native == 8:
        # against the layer on the activations as Int8Linear quantizes them (u8 per tensor, the range's ends
        # at codes 0 and ~255), so that what is left is the weights' rounding: 8-bit activations' own rounding
        # is as large (on AVX512-VNNI it made the error against fp32 inputs only 18% smaller with 8-bit weights)
        codes, scale, zero = _activation_codes(x)
        x_seen = ((codes - zero) * scale).float()
        with torch.no_grad():
            err7, err8 = ((quantized(b)(x) - layer(x_seen)).abs().mean() for b in (7, 8))
        assert err8 < 0.75 * err7


@pytest.mark.parametrize("native_bf16", [True, False])
def test_int8_attention_runs_in_bf16_on_short_sequences_where_the_cpu_has_bf16(mlm_dir, native_bf16, monkeypatch):
    """With native bf16, each int8 query/key/value product writes bf16 for sequences of up to
    INT8_BF16_ATTENTION_MAX_T positions (the attention then takes the explicit bf16 kernel) and fp32 beyond; without
    it, fp32 always. Either way the embeddings stay as close to fp32's as test_int8_stays_close_to_fp32 asks. (This
    is the int8 model on PyTorch's operators alone; on bertforge's kernels, test_kernels.py.)"""
    if bertforge.cpu.int8_weight_bits() is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    if native_bf16 and not bertforge.cpu.has_native_bf16():
        pytest.skip("the int8 model takes bf16 attention only where the CPU multiplies bf16 natively, not here")
    monkeypatch.setattr(bertforge.cpu, "has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(bertforge.kernels, "available", lambda: False)
    encoder = Encoder(mlm_dir, quantize="int8")
    qkv = encoder.model.encoder.layer[0].attention.qkv
    limit = bertforge.infer.transforms.INT8_BF16_ATTENTION_MAX_T
    with torch.no_grad():
        short, long = (qkv(torch.randn(2, t, qkv.in_features)) for t in (limit, limit + 1))
    assert short.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    assert long.dtype == torch.float32
    assert encoder.model.encoder.layer[0].attention_out.bf16_max_positions == 0  # only the attention's inputs
    fp32 = Encoder(mlm_dir).embed(TEXTS, pooling="mean")
    int8 = encoder.embed(TEXTS, pooling="mean")
    cosine = (fp32 * int8).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(int8, axis=1)
    assert cosine.min() > 0.9999 and np.abs(fp32 - int8).max() < 0.01


def test_int8_linear_takes_bf16_inputs_as_their_fp32_values():
    """The attention's bf16 output feeds the next int8 product: quantized from the same range to the same codes
    as the fp32 tensor of the same values, so the same result."""
    if bertforge.cpu.int8_weight_bits() is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    torch.manual_seed(0)
    q = Int8Linear(nn.Linear(64, 16), weight_bits=bertforge.cpu.int8_weight_bits())
    x = (torch.randn(3, 9, 64) * 2 - 0.5).bfloat16()
    with torch.no_grad():
        assert torch.equal(q(x), q(x.float()))


def test_int8_products_do_not_saturate_on_this_cpu():
    """The worst case for a kernel that sums pairs of u8 x s8 products in int16 (AVX2 without VNNI): every
    activation code near 255 and every weight at its largest code. With the weight bits this CPU gets
    (`bertforge.cpu.int8_weight_bits`) the output is the exact product of the quantized operands, up to fp32
    rounding; 8-bit weights on an AVX2-only CPU were off by 5.4 on outputs of size 21."""
    bits = bertforge.cpu.int8_weight_bits()
    if bits is None or not _has_onednn_ops():
        pytest.skip("Int8Linear runs on x86 CPUs with AVX2 or int8 dot products, where torch has oneDNN's operators")
    torch.manual_seed(0)
    layer = nn.Linear(384, 256)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(256, 384).sign() * 0.1)  # every weight code at +-(2^(bits-1) - 1)
    x = 3 + torch.rand(32, 384)  # codes from about 190 to 255, all positive: pairs of large products
    q = Int8Linear(layer, weight_bits=bits)
    with torch.no_grad():
        y = q(x).double()
    codes, scale, _ = _activation_codes(x)  # all positive: the range [0, max], zero point 0
    top = 2 ** (bits - 1) - 1
    w = (layer.weight.detach().double() / q.weight_scale.double()[:, None]).round().clamp(-top, top)
    exact = (codes @ w.T) * scale * q.weight_scale.double() + layer.bias.detach().double()
    assert float((y - exact).abs().max()) < 1e-3 * float(exact.abs().max())


# --- predict -------------------------------------------------------------------------------------------


def test_predict_classification_matches_the_model_python_and_cli(clf_dir, tokenizer, tmp_path, capsys):
    model = BertForSequenceClassification.from_pretrained(clf_dir, verbose=False).eval()
    texts = TEXTS[:4]
    results = predict_records(clf_dir, [{"text": t} for t in texts])
    for text, r in zip(texts, results, strict=True):
        with torch.no_grad():
            p = model(torch.tensor([tokenizer.encode(text, max_length=32).ids])).logits[0].softmax(-1)
        assert r["label"] == ["negative", "positive"][int(p.argmax())]
        np.testing.assert_allclose([r["probabilities"]["negative"], r["probabilities"]["positive"]], p, atol=1e-5)
        assert r["score"] == max(r["probabilities"].values())
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["predict", "--model", str(clf_dir), "--input", str(tmp_path / "in.jsonl")]) == 0
    cli = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["label"] for r in cli] == [r["label"] for r in results]
    np.testing.assert_allclose([r["score"] for r in cli], [r["score"] for r in results], atol=1e-6)
    assert main(["predict", "--model", str(clf_dir), "--text", *texts[:2]]) == 0
    assert [json.loads(line)["label"] for line in capsys.readouterr().out.splitlines()] == \
        [r["label"] for r in results[:2]]
    int8 = Predictor(clf_dir, quantize="int8").predict([{"text": t} for t in texts])
    np.testing.assert_allclose([r["score"] for r in int8], [r["score"] for r in results], atol=0.02)


def test_predict_turns_off_dropout_left_on_in_any_part_of_the_model(clf_dir):
    """A model (or one layer of it) put back into training mode by its user still predicts without dropout."""
    texts = [{"text": t} for t in TEXTS if t]
    expected = [r["probabilities"] for r in Predictor(clf_dir).predict(texts)]
    predictor = Predictor(clf_dir)
    for part in (predictor.task_model.model.bert.encoder.layer[1], predictor.task_model.model):
        part.train()
        for _ in range(2):
            got = [r["probabilities"] for r in predictor.predict(texts)]
            for a, b in zip(expected, got, strict=True):
                assert a == pytest.approx(b, abs=1e-6)
        assert not any(m.training for m in predictor.task_model.model.modules())


def test_predict_embed_and_fill_hold_off_the_cyclic_gc_and_restore_it(clf_dir, mlm_dir, monkeypatch):
    """While they run Python's cyclic collector is off; after, it is as it was (on, or off as the caller left it),
    an error included."""
    import gc

    seen = []
    real = bertforge.infer.engines._padded_batch

    def padded(*args):
        seen.append(gc.isenabled())
        return real(*args)

    monkeypatch.setattr(bertforge.infer.engines, "_padded_batch", padded)
    texts = [t for t in TEXTS if t]
    assert gc.isenabled()
    Encoder(mlm_dir).embed(texts)
    MaskFiller(mlm_dir).fill(MASKED)
    assert seen and not any(seen) and gc.isenabled()
    monkeypatch.setattr(bertforge.infer.engines, "run_model", lambda *a, **k: seen.append(gc.isenabled()) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        Predictor(clf_dir).predict([{"text": t} for t in texts])
    assert seen[-1] is False and gc.isenabled()
    gc.disable()
    try:
        Encoder(mlm_dir).embed(texts)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_predict_after_a_real_finetune(tmp_path, mlm_dir, capsys):
    from bertforge.train.finetune import FinetuneOptions, finetune

    data = tmp_path / "data"
    data.mkdir()
    rows = [("the film was good", "positive"), ("great acting", "positive"), ("bad plot", "negative"),
            ("awful movie", "negative")] * 2
    for split in ("train", "dev"):
        (data / f"{split}.csv").write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows))
    options = FinetuneOptions(epochs=1, batch_size=4, max_length=32, progress=False)
    finetune("csv", data, mlm_dir, tmp_path / "out", options=options)
    capsys.readouterr()
    assert main(["predict", "--model", str(tmp_path / "out"), "--text", "good film", "bad film"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(out) == 2 and all(r["label"] in ("negative", "positive") for r in out)
    assert all(set(r["probabilities"]) == {"negative", "positive"} for r in out)


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_predict_entities_and_answers_carry_character_spans(tmp_path, tokenizer, backend):
    from bertforge.tasks.conll import STANDARD_LABELS

    if backend == "onnx":
        pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install bertforge[onnx])")

    torch.manual_seed(2)
    ner = BertForTokenClassification(tiny_config(num_labels=len(STANDARD_LABELS)))
    with torch.no_grad():  # every word B-PER, so every word is an entity
        ner.classifier.weight.zero_()
        ner.classifier.bias[STANDARD_LABELS.index("B-PER")] = 5.0
    ner_dir = save(ner, tokenizer, tmp_path / "ner", {"task": "conll2003", "kind": "token_classification",
                                                     "options": {}, "labels": list(STANDARD_LABELS),
                                                     "max_length": 32})
    text = "john  smith lives in paris."
    [r] = predict_records(ner_dir, [{"text": text}], backend=backend)
    assert [e["text"] for e in r["entities"]] == ["john", "smith", "lives", "in", "paris", "."]
    assert all(text[e["start"]:e["end"]] == e["text"] and e["type"] == "PER" for e in r["entities"])

    qa = BertForQuestionAnswering(tiny_config(num_labels=2))
    qa_dir = save(qa, tokenizer, tmp_path / "qa", {"task": "squad", "kind": "question_answering", "options": {},
                                                  "labels": None, "max_length": 32})
    context = "john smith lives in paris and works in the film"
    records = [{"question": "where does john live ?", "context": context},
               {"text": "who works ?", "text_pair": context}]
    answers = predict_records(qa_dir, records, backend=backend)
    for a in answers:
        assert a["answer"] and context[a["start"]:a["end"]] == a["answer"] and 0 < a["score"] <= 1
    if backend == "onnx":  # the same answers as the PyTorch engine
        for a, b in zip(answers, predict_records(qa_dir, records), strict=True):
            assert (a["start"], a["end"]) == (b["start"], b["end"])
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)
    with pytest.raises(BertforgeError, match="question answering needs"):
        predict_records(qa_dir, [{"text": "no context"}], backend=backend)


def test_onnx_backend_predicts_what_the_torch_engine_does(clf_dir, mlm_dir, tmp_path, capsys):
    """ONNX Runtime behind `predict`: on the fine-tuned directory (exported on the way) and on its export, the
    PyTorch engine's probabilities to 1e-5; its int8 close to them; impossible combinations one error line."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install bertforge[onnx])")
    from bertforge.export import export_onnx

    records = [{"text": t} for t in TEXTS if t]
    expected = np.array([[r["probabilities"][k] for k in ("negative", "positive")]
                         for r in Predictor(clf_dir).predict(records)])
    export_onnx(clf_dir, tmp_path / "exported")
    for path, quantize, tolerance in ((clf_dir, None, 1e-5), (tmp_path / "exported", None, 1e-5),
                                      (clf_dir, "int8", 0.05)):
        predictor = Predictor(path, backend="onnx", quantize=quantize)
        assert type(predictor.task_model.model).__name__ == "OrtModel"
        got = np.array([[r["probabilities"][k] for k in ("negative", "positive")]
                        for r in predictor.predict(records, batch_size=2)])
        np.testing.assert_allclose(got, expected, atol=tolerance)
    capsys.readouterr()
    assert main(["predict", "--model", str(tmp_path / "exported"), "--backend", "onnx", "--text", *TEXTS[:2]]) == 0
    cli = [json.loads(line)["probabilities"]["positive"] for line in capsys.readouterr().out.splitlines()]
    np.testing.assert_allclose(cli, expected[:2, 1], atol=1e-5)
    for flags, message in ((["--precision", "bf16"], "--backend onnx runs fp32 or int8"),
                           (["--device", "cuda"], "--backend onnx runs ONNX Runtime on the CPU")):
        assert main(["predict", "--model", str(clf_dir), "--backend", "onnx", "--text", "x", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1
    export_onnx(mlm_dir, tmp_path / "encoder")  # an encoder: nothing to predict
    assert main(["predict", "--model", str(tmp_path / "encoder"), "--backend", "onnx", "--text", "x"]) == 2
    assert "has no task.json" in capsys.readouterr().err


def test_onnx_backend_embeds_what_the_torch_engine_does(mlm_dir, clf_dir, tmp_path, capsys):
    """`embed --backend onnx`: the encoder of a pretrained or fine-tuned directory (exported on the way) or of an
    encoder export gives the PyTorch engine's vectors for every pooling it has; int8 points the same way; a task
    model's export is refused in one line."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install bertforge[onnx])")
    from bertforge.export import export_onnx

    export_onnx(mlm_dir, tmp_path / "encoder")
    # (the PyTorch directory, what the ONNX Runtime engine is given, the poolings the model has)
    for source, given, poolings in ((mlm_dir, mlm_dir, ("cls", "mean")),
                                    (mlm_dir, tmp_path / "encoder", ("cls", "mean")),
                                    (clf_dir, clf_dir, ("cls", "mean", "pooler"))):
        reference, engine = Encoder(source), Encoder(given, backend="onnx")
        for pooling in poolings:
            np.testing.assert_allclose(engine.embed(TEXTS, pooling=pooling), reference.embed(TEXTS, pooling=pooling),
                                       atol=1e-5)
    with pytest.raises(BertforgeError, match="no pooler weights"):
        Encoder(mlm_dir, backend="onnx").embed(TEXTS, pooling="pooler")
    fp32 = Encoder(mlm_dir).embed(TEXTS, pooling="mean")
    int8 = Encoder(mlm_dir, backend="onnx", quantize="int8").embed(TEXTS, pooling="mean")
    cosine = (fp32 * int8).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(int8, axis=1)
    assert cosine.min() > 0.999 and np.abs(fp32 - int8).max() > 0  # close, and really quantized
    export_onnx(clf_dir, tmp_path / "classifier")
    capsys.readouterr()
    assert main(["embed", "--model", str(tmp_path / "classifier"), "--backend", "onnx", "--text", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not an encoder's" in err and err.count("\n") == 1


def test_read_input_records_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("{braces} are text here\n\nsecond line\n")
    assert read_input_records(tmp_path / "a.txt") == [{"text": "{braces} are text here"}, {"text": "second line"}]
    (tmp_path / "b.txt").write_text('{"text": "x", "text_pair": "y"}\n{"text": "z"}\n')
    assert read_input_records(tmp_path / "b.txt") == [{"text": "x", "text_pair": "y"}, {"text": "z"}]
    (tmp_path / "c.jsonl").write_text('{"text": "x"}\nnot json\n')
    with pytest.raises(BertforgeError, match="c.jsonl:2 is not valid JSON"):
        read_input_records(tmp_path / "c.jsonl")
    (tmp_path / "d.txt").write_text("\n\n")
    with pytest.raises(BertforgeError, match="no inputs"):
        read_input_records(tmp_path / "d.txt")


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_predictions_of_two_batch_streams_are_those_of_one(clf_dir, quantize, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        records = [{"text": " ".join(["good film"] * (1 + n % 7))} for n in range(21)]
        predictor = Predictor(clf_dir, quantize=quantize)
        chosen = []
        real = bertforge.tasks.runner.run_batches
        monkeypatch.setattr("bertforge.tasks.runner.run_batches",
                            lambda fn, batches, streams: chosen.append(streams) or real(fn, batches, streams))
        default = predictor.predict(records, batch_size=4)
        one = predictor.predict(records, batch_size=4, streams=1)
        few = predictor.predict(records[:12], batch_size=4)  # 3 batches: one stream
    finally:
        torch.set_num_threads(before)
    assert chosen == [2, 1, 1]  # 21 records in 6 batches of 4: two streams by default
    assert [r["label"] for r in default] == [r["label"] for r in one]
    for a, b in zip(default, one, strict=True):
        assert a["probabilities"] == pytest.approx(b["probabilities"], abs=1e-6)
    assert [r["label"] for r in few] == [r["label"] for r in one[:12]]
    with pytest.raises(BertforgeError, match="streams must be at least 1, not 0"):
        predictor.predict(records, streams=0)
