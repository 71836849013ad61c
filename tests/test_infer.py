"""Inference engines from Python and the CLI: fill-mask, embeddings, task predictions (with character spans),
length-grouped batching, input files and batch streams.

Models are tiny and random (H 32, 2 layers) over a vocabulary of whole words (conftest's `mlm_dir`, `clf_dir`,
`word_tokenizer`), so every expected value is computed here by hand, one text at a time and unpadded. The int8
paths are in test_infer_int8.py, ONNX Runtime behind the engines in test_infer_onnx.py.
"""

import json

import numpy as np
import pytest
import torch
from infer_support import MASKED, TEXTS, VOCAB, save, unpadded_states

import bertforge.infer.engines
import bertforge.tasks.runner
from bertforge import BertforgeError, BertForMaskedLM, BertModel
from bertforge.cli import main
from bertforge.commands.inputs import read_input_records
from bertforge.infer import Encoder, EngineOptions, MaskFiller, Predictor, predict_records
from bertforge.models import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification

# --- fill-mask -----------------------------------------------------------------------------------------


def test_fill_mask_top1_is_the_token_the_head_favours(tmp_path, word_tokenizer, tiny_config):
    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_config.replace(vocab_size=len(VOCAB)))
    with torch.no_grad():
        model.cls.predictions.bias[word_tokenizer.token_to_id("fox")] = 50.0
    filler = MaskFiller(save(model, word_tokenizer, tmp_path))
    masks = filler.fill("the quick brown [MASK] jumps", top_k=3)
    assert len(masks) == 1 and masks[0][0]["token"] == "fox" and masks[0][0]["score"] > 0.99


def test_fill_mask_matches_the_dense_head_one_text_at_a_time_in_mask_order(mlm_dir, word_tokenizer):
    filler = MaskFiller(mlm_dir)
    batched = filler.fill(MASKED, top_k=4, max_tokens=40)  # small budget: several batches, padding in each
    model = BertForMaskedLM.from_pretrained(mlm_dir, verbose=False).eval()
    for text, got in zip(MASKED, batched, strict=True):
        ids = word_tokenizer.encode(text).ids
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0].softmax(-1)  # (T, V): the head on every position
        positions = [i for i, t in enumerate(ids) if t == word_tokenizer.mask_id]
        assert len(got) == len(positions) == text.count("[MASK]")
        for pos, candidates in zip(positions, got, strict=True):
            p, top = probs[pos].topk(4)
            assert [c["token"] for c in candidates] == [word_tokenizer.id_to_token(int(t)) for t in top]
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


def test_embed_cls_and_mean_pooling_equal_unpadded_one_at_a_time(mlm_dir, word_tokenizer):
    encoder = Encoder(mlm_dir)
    model = BertModel.from_pretrained(mlm_dir, verbose=False).eval()
    cls_vecs = encoder.embed(TEXTS, pooling="cls", max_tokens=48)  # several batches of mixed lengths
    mean_vecs = encoder.embed(TEXTS, pooling="mean", max_tokens=48)
    assert cls_vecs.shape == (len(TEXTS), 32) and cls_vecs.dtype == np.float32
    for i, text in enumerate(TEXTS):
        states = unpadded_states(model, word_tokenizer, text)
        np.testing.assert_allclose(cls_vecs[i], states[0].numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(mean_vecs[i], states.mean(0).numpy(), atol=1e-5, rtol=0)
    unit = encoder.embed(TEXTS, pooling="mean", normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(unit, mean_vecs / np.linalg.norm(mean_vecs, axis=1, keepdims=True), atol=1e-6)
    assert encoder.embed([]).shape == (0, 32)


def test_embed_pooler_only_when_the_model_has_one(mlm_dir, clf_dir, word_tokenizer):
    with pytest.raises(BertforgeError, match="no pooler weights"):
        Encoder(mlm_dir).embed(TEXTS, pooling="pooler")  # a masked-LM model: never a random pooler
    pooled = Encoder(clf_dir).embed(TEXTS[:2], pooling="pooler")
    model = BertModel.from_pretrained(clf_dir, verbose=False).eval()
    with torch.no_grad():
        expected = model(torch.tensor([word_tokenizer.encode(TEXTS[0]).ids])).pooled_output[0]
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


# --- predict -------------------------------------------------------------------------------------------


def test_predict_classification_matches_the_model_python_and_cli(clf_dir, word_tokenizer, tmp_path, capsys):
    model = BertForSequenceClassification.from_pretrained(clf_dir, verbose=False).eval()
    texts = TEXTS[:4]
    results = predict_records(clf_dir, [{"text": t} for t in texts])
    for text, r in zip(texts, results, strict=True):
        with torch.no_grad():
            p = model(torch.tensor([word_tokenizer.encode(text, max_length=32).ids])).logits[0].softmax(-1)
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
    int8 = Predictor(clf_dir, EngineOptions(quantize="int8")).predict([{"text": t} for t in texts])
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


@pytest.mark.slow  # a fine-tuning run
def test_predict_after_a_real_finetune(tmp_path, mlm_dir, capsys):
    from bertforge.finetune.config import FinetuneConfig
    from bertforge.finetune.run import FinetuneOptions, finetune

    data = tmp_path / "data"
    data.mkdir()
    rows = [("the film was good", "positive"), ("great acting", "positive"), ("bad plot", "negative"),
            ("awful movie", "negative")] * 2
    for split in ("train", "dev"):
        (data / f"{split}.csv").write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows))
    options = FinetuneOptions(epochs=1, batch_size=4, max_length=32, progress=False)
    finetune(FinetuneConfig(task="csv", data_dir=str(data), init=str(mlm_dir), out_dir=str(tmp_path / "out"),
                            options=options))
    capsys.readouterr()
    assert main(["predict", "--model", str(tmp_path / "out"), "--text", "good film", "bad film"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(out) == 2 and all(r["label"] in ("negative", "positive") for r in out)
    assert all(set(r["probabilities"]) == {"negative", "positive"} for r in out)


@pytest.mark.parametrize("backend", ["torch", pytest.param("onnx", marks=pytest.mark.slow)])
def test_predict_entities_and_answers_carry_character_spans(tmp_path, word_tokenizer, tiny_config, backend):
    from bertforge.tasks.conll import STANDARD_LABELS

    if backend == "onnx":
        pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install bertforge[onnx])")

    torch.manual_seed(2)
    ner = BertForTokenClassification(tiny_config.replace(vocab_size=len(VOCAB), num_labels=len(STANDARD_LABELS)))
    with torch.no_grad():  # every word B-PER, so every word is an entity
        ner.classifier.weight.zero_()
        ner.classifier.bias[STANDARD_LABELS.index("B-PER")] = 5.0
    ner_dir = save(ner, word_tokenizer, tmp_path / "ner", {"task": "conll2003", "kind": "token_classification",
                                                     "options": {}, "labels": list(STANDARD_LABELS),
                                                     "max_length": 32})
    text = "john  smith lives in paris."
    [r] = predict_records(ner_dir, [{"text": text}], EngineOptions(backend=backend))
    assert [e["text"] for e in r["entities"]] == ["john", "smith", "lives", "in", "paris", "."]
    assert all(text[e["start"]:e["end"]] == e["text"] and e["type"] == "PER" for e in r["entities"])

    qa = BertForQuestionAnswering(tiny_config.replace(vocab_size=len(VOCAB), num_labels=2))
    qa_dir = save(qa, word_tokenizer, tmp_path / "qa", {"task": "squad", "kind": "question_answering", "options": {},
                                                  "labels": None, "max_length": 32})
    context = "john smith lives in paris and works in the film"
    records = [{"question": "where does john live ?", "context": context},
               {"text": "who works ?", "text_pair": context}]
    answers = predict_records(qa_dir, records, EngineOptions(backend=backend))
    for a in answers:
        assert a["answer"] and context[a["start"]:a["end"]] == a["answer"] and 0 < a["score"] <= 1
    if backend == "onnx":  # the same answers as the PyTorch engine
        for a, b in zip(answers, predict_records(qa_dir, records), strict=True):
            assert (a["start"], a["end"]) == (b["start"], b["end"])
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)
    with pytest.raises(BertforgeError, match="question answering needs"):
        predict_records(qa_dir, [{"text": "no context"}], EngineOptions(backend=backend))


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
        predictor = Predictor(clf_dir, EngineOptions(quantize=quantize))
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

