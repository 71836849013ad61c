"""Task metrics. Every score is a percentage (0-100), as in the BERT paper's tables, and higher is better.

- Classification: accuracy, binary F1 of a named positive label, macro F1, Matthews correlation
  (scikit-learn), Pearson and Spearman correlation (scipy).
- SQuAD v1.1: exact match and F1 by the official evaluation rules (normalise: lowercase, drop punctuation,
  drop the articles a/an/the, collapse whitespace; the best score over the ground truths; unanswered
  questions score 0).
- Entity F1 exactly as conlleval counts it: a chunk starts at B-, at an I- after O, or at a type change;
  the same code scores IOB1 (the original CoNLL-2003 files) and IOB2, and IOBES the way conlleval's common
  ports extend it (E- and S- end a chunk, S- starts one).

A correlation or Matthews coefficient that is undefined (a constant input) is reported as 0, so a
"best model" comparison never meets NaN.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Hashable, Sequence


def accuracy(predictions: Sequence[Hashable], references: Sequence[Hashable]) -> float:
    _check_lengths(predictions, references)
    if not references:
        return 0.0
    return 100.0 * sum(p == r for p, r in zip(predictions, references, strict=True)) / len(references)


def binary_f1(predictions: Sequence[Hashable], references: Sequence[Hashable], positive: Hashable) -> float:
    """F1 of the `positive` class (MRPC, QQP: the "is a paraphrase / duplicate" label)."""
    _check_lengths(predictions, references)
    tp = sum(p == positive and r == positive for p, r in zip(predictions, references, strict=True))
    fp = sum(p == positive and r != positive for p, r in zip(predictions, references, strict=True))
    fn = sum(p != positive and r == positive for p, r in zip(predictions, references, strict=True))
    return 100.0 * _f1(tp, tp + fp, tp + fn)


def macro_f1(predictions: Sequence[Hashable], references: Sequence[Hashable]) -> float:
    """Unweighted mean of the per-class F1 over the classes seen in either list."""
    _check_lengths(predictions, references)
    classes = sorted(set(predictions) | set(references), key=str)
    if not classes:
        return 0.0
    return sum(binary_f1(predictions, references, c) for c in classes) / len(classes)


def matthews(predictions: Sequence[Hashable], references: Sequence[Hashable]) -> float:
    _check_lengths(predictions, references)
    if not references:
        return 0.0
    from sklearn.metrics import matthews_corrcoef  # imported where used: a second to import, for 2 of the tasks

    return _finite(100.0 * matthews_corrcoef([str(r) for r in references], [str(p) for p in predictions]))


def pearson(predictions: Sequence[float], references: Sequence[float]) -> float:
    _check_lengths(predictions, references)
    if len(references) < 2 or _constant(predictions) or _constant(references):
        return 0.0
    from scipy.stats import pearsonr  # imported where used, as matthews' scikit-learn

    return _finite(100.0 * float(pearsonr(predictions, references)[0]))


def spearman(predictions: Sequence[float], references: Sequence[float]) -> float:
    _check_lengths(predictions, references)
    if len(references) < 2 or _constant(predictions) or _constant(references):
        return 0.0
    from scipy.stats import spearmanr  # imported where used, as matthews' scikit-learn

    return _finite(100.0 * float(spearmanr(predictions, references)[0]))


# --- SQuAD v1.1 ----------------------------------------------------------------------------------------

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """The official SQuAD v1.1 normalisation: lowercase, drop punctuation, drop articles, fix whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def squad_exact_match(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def squad_f1(prediction: str, ground_truth: str) -> float:
    pred = normalize_answer(prediction).split()
    gold = normalize_answer(ground_truth).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    return _f1(same, len(pred), len(gold))


def squad_scores(predictions: dict[str, str], references: dict[str, Sequence[str]]) -> dict[str, float]:
    """`predictions` {question id: answer text}; `references` {question id: [ground-truth answers]}.

    Averages over the references; a question without a prediction scores 0 (as the official script).
    """
    if not references:
        return {"exact_match": 0.0, "f1": 0.0}
    em = f1 = 0.0
    for qid, truths in references.items():
        if qid not in predictions:
            continue
        pred = predictions[qid]
        em += max((squad_exact_match(pred, t) for t in truths), default=0.0)
        f1 += max((squad_f1(pred, t) for t in truths), default=0.0)
    return {"exact_match": 100.0 * em / len(references), "f1": 100.0 * f1 / len(references)}


# --- conlleval entity scores ---------------------------------------------------------------------------


def split_tag(tag: str) -> tuple[str, str]:
    """'B-PER' -> ('B', 'PER'); 'O' -> ('O', ''); a tag without a prefix counts as inside ('I', tag)."""
    if tag == "O":
        return "O", ""
    prefix, sep, kind = tag.partition("-")
    if sep and prefix in ("B", "I", "E", "S"):
        return prefix, kind
    return "I", tag


def _chunk_end(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """Did a chunk end between the previous word and this one? (conlleval's endOfChunk.)"""
    if prev_tag in ("E", "S"):
        return True
    if prev_tag in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev_tag != "O" and prev_type != type_


def _chunk_start(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """Did a chunk start at this word? (conlleval's startOfChunk: B, I after O, or a type change.)"""
    if tag in ("B", "S"):
        return True
    if tag in ("I", "E") and prev_tag in ("O", "E", "S"):
        return True
    return tag != "O" and prev_type != type_


def chunks(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Entity chunks of one sentence as (type, first word, last word), inclusive, by conlleval's rules."""
    found = []
    prev_tag, prev_type = "O", ""
    start = None
    for i, raw in enumerate([*tags, "O"]):  # a final O closes the last chunk, like conlleval's boundary
        tag, type_ = split_tag(raw)
        if start is not None and _chunk_end(prev_tag, tag, prev_type, type_):
            found.append((prev_type, start, i - 1))
            start = None
        if _chunk_start(prev_tag, tag, prev_type, type_):
            start = i
        prev_tag, prev_type = tag, type_
    return found


def conll_scores(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Entity precision, recall and F1 (a chunk counts when its type and both ends match), the token
    accuracy conlleval also prints, and `f1_<TYPE>` per entity type. Inputs: one tag list per sentence."""
    _check_lengths(predictions, references)
    guessed: Counter[str] = Counter()
    gold: Counter[str] = Counter()
    correct: Counter[str] = Counter()
    tokens = right = 0
    for i, (pred, ref) in enumerate(zip(predictions, references, strict=True)):
        if len(pred) != len(ref):
            raise ValueError(f"sentence {i}: {len(pred)} predicted tags for {len(ref)} words")
        tokens += len(ref)
        right += sum(p == r for p, r in zip(pred, ref, strict=True))
        pred_chunks, ref_chunks = set(chunks(pred)), set(chunks(ref))
        guessed.update(c[0] for c in pred_chunks)
        gold.update(c[0] for c in ref_chunks)
        correct.update(c[0] for c in pred_chunks & ref_chunks)
    n_guessed, n_gold, n_correct = sum(guessed.values()), sum(gold.values()), sum(correct.values())
    scores = {
        "precision": 100.0 * n_correct / n_guessed if n_guessed else 0.0,
        "recall": 100.0 * n_correct / n_gold if n_gold else 0.0,
        "f1": 100.0 * _f1(n_correct, n_guessed, n_gold),
        "accuracy": 100.0 * right / tokens if tokens else 0.0,
    }
    for kind in sorted(set(guessed) | set(gold)):
        scores[f"f1_{kind}"] = 100.0 * _f1(correct[kind], guessed[kind], gold[kind])
    return scores


# --- helpers -------------------------------------------------------------------------------------------


def _f1(correct: int, predicted: int, actual: int) -> float:
    """F1 from counts; 0 when precision or recall is undefined or zero (conlleval, SQuAD, sklearn agree)."""
    if correct == 0 or predicted == 0 or actual == 0:
        return 0.0
    precision, recall = correct / predicted, correct / actual
    return 2 * precision * recall / (precision + recall)


def _check_lengths(predictions: Sequence, references: Sequence) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")


def _constant(values: Sequence[float]) -> bool:
    return len(set(values)) <= 1


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
