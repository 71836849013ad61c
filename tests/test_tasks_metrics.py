"""Metrics against scikit-learn, scipy and seqeval, and the official rules on hand-made cases."""

from __future__ import annotations

import random

import pytest

from bertforge.tasks import get_task
from bertforge.tasks import metrics as M


def _labels(rng: random.Random, n: int, classes: list[str]) -> list[str]:
    return [rng.choice(classes) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_classification_metrics_match_sklearn(seed):
    from sklearn.metrics import f1_score, matthews_corrcoef  # here: scipy and sklearn take 1 s of collection

    rng = random.Random(seed)
    refs = _labels(rng, 200, ["0", "1"])
    preds = [r if rng.random() < 0.7 else rng.choice(["0", "1"]) for r in refs]
    assert M.binary_f1(preds, refs, "1") == pytest.approx(100 * f1_score(refs, preds, pos_label="1"))
    assert M.matthews(preds, refs) == pytest.approx(100 * matthews_corrcoef(refs, preds))
    refs3 = _labels(rng, 200, ["a", "b", "c"])
    preds3 = [r if rng.random() < 0.6 else rng.choice(["a", "b", "c"]) for r in refs3]
    assert M.macro_f1(preds3, refs3) == pytest.approx(100 * f1_score(refs3, preds3, average="macro"))
    assert M.matthews(preds3, refs3) == pytest.approx(100 * matthews_corrcoef(refs3, preds3))
    assert M.accuracy(preds3, refs3) == pytest.approx(100 * sum(p == r for p, r in zip(preds3, refs3,
                                                                                       strict=True)) / 200)


@pytest.mark.parametrize("seed", range(3))
def test_correlations_match_scipy(seed):
    from scipy.stats import pearsonr, spearmanr

    rng = random.Random(seed)
    refs = [rng.uniform(0, 5) for _ in range(100)]
    preds = [r + rng.gauss(0, 1.5) for r in refs]
    preds[3] = preds[4]  # a tie, for Spearman's ranks
    assert M.pearson(preds, refs) == pytest.approx(100 * pearsonr(preds, refs)[0])
    assert M.spearman(preds, refs) == pytest.approx(100 * spearmanr(preds, refs)[0])


def test_undefined_scores_are_zero_not_nan():
    assert M.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) == 0.0
    assert M.spearman([1.0, 2.0], [3.0, 3.0]) == 0.0
    assert M.matthews(["1", "1", "1"], ["0", "1", "1"]) == 0.0
    assert M.binary_f1(["0", "0"], ["0", "0"], "1") == 0.0


def test_glue_task_metrics_by_paper():
    from sklearn.metrics import f1_score

    assert get_task("cola").main_metric == "mcc"
    assert get_task("stsb").main_metric == "spearman"
    assert get_task("mrpc").main_metric == get_task("qqp").main_metric == "f1"
    for name in ("sst2", "mnli", "qnli", "rte", "wnli"):
        assert get_task(name).main_metric == "accuracy"
    mrpc = get_task("mrpc")
    refs = ["1", "1", "0", "0", "1"]
    preds = ["1", "0", "0", "1", "1"]
    scores = mrpc.metric(preds, refs)
    assert scores == {"f1": pytest.approx(100 * f1_score(refs, preds, pos_label="1")), "accuracy": 60.0}
    assert mrpc.metric([1, 0, 0, 1, 1], refs) == scores  # class ids are mapped through the labels
    stsb = get_task("stsb").metric([1.0, 2.0, 2.5, 4.0], [0.5, 2.5, 2.0, 5.0])
    assert set(stsb) == {"spearman", "pearson"}


# --- SQuAD v1.1, by the official rules -------------------------------------------------------------------


def test_squad_normalisation():
    assert M.normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert M.normalize_answer("an apple a day") == "apple day"
    assert M.normalize_answer("theatre") == "theatre"  # only whole words are articles
    assert M.normalize_answer("A-1 (U.S.)") == "a1 us"  # punctuation first, so "a-1" is no article


def test_squad_exact_match_and_f1_by_hand():
    assert M.squad_exact_match("the Denver Broncos", "Denver Broncos") == 1.0
    assert M.squad_exact_match("Denver Broncos.", "denver broncos") == 1.0
    assert M.squad_exact_match("Broncos", "Denver Broncos") == 0.0
    # pred "broncos" vs gold "denver broncos": P = 1, R = 1/2, F1 = 2/3
    assert M.squad_f1("Broncos", "Denver Broncos") == pytest.approx(2 / 3)
    # pred "denver broncos won" vs gold "broncos": P = 1/3, R = 1, F1 = 1/2
    assert M.squad_f1("Denver Broncos won", "the Broncos") == pytest.approx(0.5)
    # repeated tokens count by multiplicity: pred "a a b" -> "b" after articles; use non-articles
    assert M.squad_f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert M.squad_f1("", "anything") == 0.0
    assert M.squad_f1("the", "a") == 0.0  # both normalise to nothing: no common token


def test_squad_scores_take_the_best_ground_truth_and_count_unanswered():
    refs = {"q1": ["Denver Broncos", "The Broncos"], "q2": ["Santa Clara, California", "Levi's Stadium"],
            "q3": ["1990"]}
    preds = {"q1": "Broncos", "q2": "Levi's Stadium in Santa Clara"}
    scores = M.squad_scores(preds, refs)
    # q1: EM 1 (vs "The Broncos"); q2: EM 0, F1 max(vs "santa clara california": P 2/5 R 2/3 -> 0.5,
    # vs "levis stadium": P 2/5 R 1 -> 4/7) = 4/7; q3 unanswered: 0
    assert scores["exact_match"] == pytest.approx(100 * 1 / 3)
    assert scores["f1"] == pytest.approx(100 * (1 + 4 / 7) / 3)


# --- conlleval entity scores --------------------------------------------------------------------------------


def test_chunks_follow_conlleval():
    assert M.chunks(["B-PER", "I-PER", "O", "B-LOC"]) == [("PER", 0, 1), ("LOC", 3, 3)]
    # IOB1: I- after O starts an entity; B- only separates two adjacent entities of one type
    assert M.chunks(["I-PER", "I-PER", "B-PER", "O", "I-LOC"]) == [("PER", 0, 1), ("PER", 2, 2), ("LOC", 4, 4)]
    # a type change inside an entity starts a new one
    assert M.chunks(["B-PER", "I-LOC", "I-LOC"]) == [("PER", 0, 0), ("LOC", 1, 2)]
    assert M.chunks(["I-ORG", "I-MISC"]) == [("ORG", 0, 0), ("MISC", 1, 1)]
    # IOBES
    assert M.chunks(["S-PER", "B-LOC", "E-LOC", "S-LOC"]) == [("PER", 0, 0), ("LOC", 1, 2), ("LOC", 3, 3)]
    assert M.chunks(["O", "O"]) == []


def test_conll_scores_by_hand():
    gold = [["B-PER", "I-PER", "O", "B-LOC", "O"], ["I-ORG", "I-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG", "O"],  # PER right, LOC typed ORG
            ["B-ORG", "I-ORG", "O"]]                 # IOB2 B-ORG I-ORG == IOB1 I-ORG I-ORG: right
    s = M.conll_scores(pred, gold)
    # guessed 3 (PER, ORG, ORG), gold 3 (PER, LOC, ORG), correct 2
    assert s["precision"] == pytest.approx(200 / 3)
    assert s["recall"] == pytest.approx(200 / 3)
    assert s["f1"] == pytest.approx(200 / 3)
    assert s["accuracy"] == pytest.approx(100 * 6 / 8)  # B-ORG vs I-ORG counts as a wrong tag
    assert s["f1_PER"] == 100.0 and s["f1_LOC"] == 0.0
    assert s["f1_ORG"] == pytest.approx(100 * 2 * 0.5 * 1 / 1.5)  # P 1/2, R 1/1


def test_conll_scores_boundary_and_type_change_cases():
    # I- after O in the prediction starts an entity of its own: [I-PER I-PER] is one PER spanning 0-1
    assert M.conll_scores([["O", "I-PER", "I-PER"]], [["O", "B-PER", "I-PER"]])["f1"] == 100.0
    # a type change inside: gold one LOC of 3 words; pred LOC, MISC, LOC = 3 chunks, none right
    s = M.conll_scores([["B-LOC", "I-MISC", "I-LOC"]], [["B-LOC", "I-LOC", "I-LOC"]])
    assert (s["precision"], s["recall"], s["f1"]) == (0.0, 0.0, 0.0)
    # a split entity: gold B-PER I-PER, pred B-PER B-PER -> 2 guessed, 0 right
    s = M.conll_scores([["B-PER", "B-PER"]], [["B-PER", "I-PER"]])
    assert (s["precision"], s["recall"]) == (0.0, 0.0)
    # nothing predicted, nothing gold: all zeros (conlleval prints 0.00)
    s = M.conll_scores([["O"]], [["O"]])
    assert (s["precision"], s["recall"], s["f1"], s["accuracy"]) == (0.0, 0.0, 0.0, 100.0)


def test_conll_scores_match_seqeval_on_iob2():
    seqeval = pytest.importorskip("seqeval.metrics", reason="seqeval is a test dependency (make setup)")
    rng = random.Random(0)
    tags = ["O", "O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-MISC", "I-MISC"]
    gold, pred = [], []
    for _ in range(300):
        n = rng.randint(1, 12)
        g = [rng.choice(tags) for _ in range(n)]
        gold.append(g)
        pred.append([t if rng.random() < 0.75 else rng.choice(tags) for t in g])
    s = M.conll_scores(pred, gold)
    assert s["precision"] == pytest.approx(100 * seqeval.precision_score(gold, pred))
    assert s["recall"] == pytest.approx(100 * seqeval.recall_score(gold, pred))
    assert s["f1"] == pytest.approx(100 * seqeval.f1_score(gold, pred))


# conlleval's own counting, restated from its rules: tag pairs that end/start a chunk, and a token-by-token
# "inCorrect" state (a correct chunk starts together in both and ends together with the same type).
# The B/I/O pairs are conlleval's; the E/S pairs are the IOBES extension its common ports use.
_ENDS = {("B", "B"), ("B", "O"), ("I", "B"), ("I", "O"),
         ("E", "E"), ("E", "I"), ("E", "O"), ("B", "S"), ("I", "S"), ("E", "B"), ("E", "S"), ("S", "B"),
         ("S", "I"), ("S", "O"), ("S", "E"), ("S", "S")}
_STARTS = {("B", "B"), ("I", "B"), ("O", "B"), ("O", "I"),
           ("E", "E"), ("E", "I"), ("O", "E"), ("S", "E"), ("S", "I"), ("E", "B"), ("S", "B"), ("B", "S"),
           ("I", "S"), ("O", "S"), ("E", "S"), ("S", "S")}


def _conlleval_counts(predictions, references):
    def split(t):
        return ("O", "") if t == "O" else tuple(t.split("-", 1))

    def end(pt, t, ptype, typ):
        return (pt, t) in _ENDS or (pt != "O" and ptype != typ)

    def start(pt, t, ptype, typ):
        return (pt, t) in _STARTS or (t != "O" and ptype != typ)

    correct = guessed = gold = 0
    in_correct = False
    lg, lgt, lc, lct = "O", "", "O", ""
    pairs = [p for pred, ref in zip(predictions, references, strict=True)
             for p in [*zip(pred, ref, strict=True), ("O", "O")]]  # a boundary after each sentence
    for g, c in pairs:
        (gt, gtype), (ct, ctype) = split(g), split(c)
        if in_correct:
            g_end, c_end = end(lg, gt, lgt, gtype), end(lc, ct, lct, ctype)
            if g_end and c_end and lgt == lct:
                in_correct = False
                correct += 1
            elif g_end != c_end or gtype != ctype:
                in_correct = False
        g_start, c_start = start(lg, gt, lgt, gtype), start(lc, ct, lct, ctype)
        if g_start and c_start and gtype == ctype:
            in_correct = True
        gold += c_start
        guessed += g_start
        lg, lgt, lc, lct = gt, gtype, ct, ctype
    return correct, guessed, gold


@pytest.mark.parametrize("scheme", ["IOB1", "IOB2", "IOBES", "mixed"])
def test_conll_scores_equal_conllevals_counting(scheme):
    prefixes = {"IOB1": "I", "IOB2": "BI", "IOBES": "BIES", "mixed": "BIES"}[scheme]
    tags = ["O", "O"] + [f"{p}-{t}" for p in prefixes for t in ("PER", "LOC", "ORG")]
    if scheme == "IOB1":
        tags.append("B-PER")
    rng = random.Random(scheme)
    gold, pred = [], []
    for _ in range(400):
        g = [rng.choice(tags) for _ in range(rng.randint(1, 10))]
        gold.append(g)
        pred.append([t if rng.random() < 0.7 else rng.choice(tags) for t in g])
    correct, guessed, found = _conlleval_counts(pred, gold)
    s = M.conll_scores(pred, gold)
    assert s["precision"] == pytest.approx(100 * correct / guessed)
    assert s["recall"] == pytest.approx(100 * correct / found)
