"""A single text longer than the sequence length read in windows (`--windows`): where the windows start, the
features they give, and the mean of their outputs in predict, evaluate and fine-tuning's dev scores."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from infer_support import WORDS
from safetensors.torch import load_file, save_file

from bertforge.infer import Predictor
from bertforge.tasks.base import TextExample
from bertforge.tasks.classification import SequenceTask
from bertforge.tasks.features import sequence_features, window_starts

ALPHA = [w for w in WORDS if w.isalpha()]  # one token each in `word_tokenizer`'s vocabulary
LABELS = {"negative": 0, "positive": 1}


def test_window_starts_by_hand():
    assert window_starts(10, 30, 8) == [0] and window_starts(30, 30, 8) == [0]
    assert window_starts(31, 30, 8) == [0, 1]  # the last window moved back to end where the text does
    assert window_starts(300, 126, 8) == [0, 126, 174] and window_starts(252, 126, 8) == [0, 126]
    assert window_starts(1000, 100, 4) == [0, 300, 600, 900]  # 10 needed, 4 allowed: spread from first to last
    assert window_starts(1000, 100, 1) == [0]


@given(n=st.integers(1, 5000), width=st.integers(1, 600), most=st.integers(1, 20))
def test_windows_are_full_and_cover_the_text_or_spread_over_it(n, width, most):
    starts = window_starts(n, width, most)
    assert starts[0] == 0 and len(starts) <= most and all(np.diff(starts) > 0)
    if n <= width or most == 1:
        assert starts == [0]
        return
    assert starts[-1] == n - width  # every window full, the last ending with the text
    if math.ceil(n / width) <= most:  # no token left out
        assert len(starts) == math.ceil(n / width) and all(np.diff(starts) <= width)
    else:
        assert len(starts) == most


def _ids(tokenizer, words: list[str]) -> list[int]:
    return [tokenizer.token_to_id(w) for w in words]


def test_a_long_text_gives_full_windows_and_a_short_one_its_usual_feature(word_tokenizer):
    tok = word_tokenizer
    words = [ALPHA[i * 7 % len(ALPHA)] for i in range(75)]
    short = TextExample(id="0", text="the film was good", source="t", label="negative")
    long = TextExample(id="1", text=" ".join(words), source="t", label="positive")
    empty = TextExample(id="2", text="", source="t", label="negative")
    one = sequence_features([short, long, empty], tok, 32, LABELS)
    many = sequence_features([short, long, empty], tok, 32, LABELS, windows=8)
    assert many[0] == one[0] and many[-1] == one[-1]  # a text within the length, and an empty one: as before
    assert one[1]["input_ids"] == [tok.cls_id, *_ids(tok, words[:30]), tok.sep_id]
    assert [f["example_index"] for f in many] == [0, 1, 1, 1, 2] and all(f["labels"] == 1 for f in many[1:4])
    for f, start in zip(many[1:4], (0, 30, 45), strict=True):  # 75 tokens, windows of 30: 0, 30, then 45 to the end
        assert f["input_ids"] == [tok.cls_id, *_ids(tok, words[start:start + 30]), tok.sep_id]
        assert f["token_type_ids"] == [0] * 32
    pairs = [TextExample(id="0", text=long.text, text_pair="a good film", source="t", label="positive")]
    assert sequence_features(pairs, tok, 32, LABELS, windows=8) == sequence_features(pairs, tok, 32, LABELS)


def test_an_examples_outputs_are_the_mean_of_its_windows():
    features = [{"example_index": i} for i in (0, 0, 1, 2, 2, 2)]
    logits = np.array([[1, 3], [3, 1], [5, -5], [0, 3], [3, 0], [6, 0]], np.float32)
    merged = SequenceTask.per_example(features, logits, 3)
    assert np.array_equal(merged, np.array([[2, 2], [5, -5], [3, 1]], np.float32))
    alone = [{"example_index": i} for i in range(3)]
    assert np.array_equal(SequenceTask.per_example(alone, logits[:3], 3), logits[:3])
    scores = np.array([1.0, 2.0, 4.0, 0.5], np.float32)  # regression: one score a window
    assert np.array_equal(SequenceTask.per_example(features[:4], scores, 3), np.array([1.5, 4.0, 0.5], np.float32))


def test_predict_averages_the_logits_of_a_long_texts_windows(clf_dir, tmp_path):
    """clf_dir reads 32 tokens: a text of two 30-word halves is read as exactly those halves, and its
    probabilities are the softmax of the mean of theirs' logits (a log-probability is its logit less a constant).
    The random model's classifier is scaled up so that its outputs differ from text to text."""
    sharp = tmp_path / "clf"
    shutil.copytree(clf_dir, sharp)
    weights = load_file(sharp / "model.safetensors")
    weights["classifier.weight"] = weights["classifier.weight"] * 1000
    save_file(weights, sharp / "model.safetensors")
    first = " ".join(ALPHA[i % len(ALPHA)] for i in range(30))
    second = " ".join(ALPHA[(5 * i + 3) % len(ALPHA)] for i in range(30))
    predictor = Predictor(sharp)
    p_first, p_second, p_one, p_both = (
        np.array(list(r["probabilities"].values())) for r in
        [*predictor.predict([{"text": first}, {"text": second}], windows=1),
         *predictor.predict([{"text": f"{first} {second}"}], windows=1),
         *predictor.predict([{"text": f"{first} {second}"}])])
    assert np.allclose(p_one, p_first, atol=1e-6)  # one window: the first 30 words
    odds = {name: float(np.log(p[1] / p[0])) for name, p in
            (("first", p_first), ("second", p_second), ("both", p_both))}  # a logit difference
    gap = abs(odds["first"] - odds["second"])
    assert gap > 0.01 and abs(odds["both"] - (odds["first"] + odds["second"]) / 2) < 0.01 * gap, odds


@pytest.mark.parametrize("windows", [0, 1001])
def test_predict_refuses_windows_out_of_range(clf_dir, windows, capsys):
    from bertforge.cli import main

    assert main(["predict", "--model", str(clf_dir), "--text", "a film", "--windows", str(windows)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--windows" in err[0]
