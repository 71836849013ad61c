"""SQuAD v1.1: official JSON, sliding windows, answer round trips through offsets, post-processing, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bertforge import Tokenizer
from bertforge.errors import BertforgeError
from bertforge.tasks import collate, get_task
from bertforge.tokenizer import VocabOptions

CONTEXT_1 = (
    "Super Bowl 50 was an American football game to determine the champion of the National Football League "
    "(NFL) for the 2015 season. The American Football Conference (AFC) champion Denver Broncos defeated the "
    "National Football Conference (NFC) champion Carolina Panthers 24\u201310 to earn their third Super Bowl "
    "title. The game was played on February 7, 2016, at Levi's Stadium in the San Francisco Bay Area at Santa "
    "Clara, California."
)
CONTEXT_2 = (
    "Z\u00fcrich's Grossm\u00fcnster, begun around 1100, is a Romanesque-style Protestant church; its twin "
    "towers (each 64 m high) were finished in 1782 and it is the city's landmark. Huldrych Zwingli preached "
    "there from 1519."
)


def _qa(qid: str, question: str, context: str, *answers: str, start: int | None = None) -> dict:
    return {"id": qid, "question": question,
            "answers": [{"text": a, "answer_start": context.find(a) if start is None else start} for a in answers]}


SQUAD = {"version": "1.1", "data": [
    {"title": "Super_Bowl_50", "paragraphs": [{"context": CONTEXT_1, "qas": [
        _qa("q-first", "What game is this about?", CONTEXT_1, "Super Bowl 50"),
        _qa("q-afc", "Which NFL team represented the AFC at Super Bowl 50?", CONTEXT_1, "Denver Broncos",
            "The Denver Broncos"),
        _qa("q-score", "What was the final score?", CONTEXT_1, "24\u201310"),
        _qa("q-date", "When was the game played?", CONTEXT_1, "February 7, 2016"),
        _qa("q-venue", "Where was Super Bowl 50 held?", CONTEXT_1, "Levi's Stadium"),
        _qa("q-last", "In which state is Santa Clara?", CONTEXT_1, "California."),
        _qa("q-nfl", "What does NFL stand for?", CONTEXT_1, "National Football League"),
    ]}]},
    {"title": "Zurich", "paragraphs": [{"context": CONTEXT_2, "qas": [
        _qa("z-church", "Which church is Zurich's landmark?", CONTEXT_2, "Grossm\u00fcnster"),
        _qa("z-height", "How high are the towers?", CONTEXT_2, "64 m"),
        _qa("z-year", "When were the towers finished?", CONTEXT_2, "1782"),
        _qa("z-who", "Who preached there from 1519?", CONTEXT_2, "Huldrych Zwingli"),
        _qa("z-town", "Which city?", CONTEXT_2, "Z\u00fcrich"),
    ]}]},
]}


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return Tokenizer.from_pretrained(minilm_dir)


@pytest.fixture
def squad_dir(tmp_path):
    (tmp_path / "train-v1.1.json").write_text(json.dumps(SQUAD))
    (tmp_path / "dev-v1.1.json").write_text(json.dumps(SQUAD))
    return tmp_path


def test_reads_official_json(squad_dir):
    task = get_task("squad")
    assert task.kind == "question_answering" and task.main_metric == "f1" and task.num_labels == 2
    train = task.read(squad_dir, "train")
    assert len(train) == 12 and train[1].id == "q-afc" and train[1].title == "Super_Bowl_50"
    assert train[1].answers == ["Denver Broncos", "The Denver Broncos"]
    ex = train[5]
    assert ex.context[ex.answer_start:ex.answer_start + len(ex.answer_text)] == "California."
    assert len(task.read(squad_dir / "dev-v1.1.json", "dev")) == 12  # a file serves any split


@pytest.mark.parametrize(("max_length", "stride"), [(384, 128), (40, 8), (32, 5), (28, 16)])
def test_answers_round_trip_through_windows(squad_dir, tok, max_length, stride):
    task = get_task("squad", doc_stride=stride, max_query_length=12)
    train = task.read(squad_dir, "train")
    features = task.features(train, tok, max_length=max_length)
    found = dict.fromkeys(range(len(train)), 0)
    for f in features:
        ex = train[f["example_index"]]
        assert f["example_id"] == ex.id
        ids, types, offsets = f["input_ids"], f["token_type_ids"], f["offset_mapping"]
        assert len(ids) == len(types) == len(offsets) == len(f["token_is_max_context"]) <= max_length
        assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id
        q_len = types.index(1) - 2
        assert q_len <= 12 and ids[q_len + 1] == tok.sep_id
        assert all(o is None for o in offsets[: q_len + 2]) and offsets[-1] is None
        s, e = f["start_positions"], f["end_positions"]
        if s == 0:
            assert e == 0  # this window does not hold the whole answer: point at [CLS]
            continue
        assert offsets[s] is not None and offsets[e] is not None and s <= e
        assert ex.context[offsets[s][0]:offsets[e][1]] == ex.answer_text
        found[f["example_index"]] += 1
    assert all(found.values()), "every answer is inside at least one window"
    if max_length < 64:
        assert len(features) > 2 * len(train)  # several windows per example

    # every context token is "max context" in exactly one window, and all windows cover the context
    for i, ex in enumerate(train):
        seen: dict[tuple, int] = {}
        for f in (f for f in features if f["example_index"] == i):
            for off, best in zip(f["offset_mapping"], f["token_is_max_context"], strict=True):
                if off is not None:
                    seen[off] = seen.get(off, 0) + best
        enc = tok.encode(ex.context, add_special_tokens=False)
        assert set(seen) == {tuple(o) for o in enc.offsets}
        assert all(v == 1 for v in seen.values())


def _gold_logits(features, width: int, noise_seed: int = 0):
    rng = np.random.default_rng(noise_seed)
    starts = rng.normal(0, 0.1, (len(features), width))
    ends = rng.normal(0, 0.1, (len(features), width))
    for i, f in enumerate(features):
        if f["start_positions"]:
            starts[i, f["start_positions"]] += 10
            ends[i, f["end_positions"]] += 10
    return starts, ends


@pytest.mark.parametrize(("max_length", "stride"), [(384, 128), (36, 6)])
def test_postprocess_recovers_answers_and_scores_100(squad_dir, tok, max_length, stride):
    task = get_task("squad", doc_stride=stride, max_query_length=12)
    train = task.read(squad_dir, "train")
    features = task.features(train, tok, max_length=max_length)
    predictions = task.decode(train, features, _gold_logits(features, max_length))
    batch = collate(features, tok.pad_id)
    assert batch["start_positions"].tolist() == [f["start_positions"] for f in features]
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions"}
    assert predictions == {ex.id: ex.answer_text for ex in train}
    assert task.metric(predictions, task.references(train)) == {"exact_match": 100.0, "f1": 100.0}
    # per-feature lists of logits work too (unpadded)
    starts, ends = _gold_logits(features, max_length)
    ragged = ([s[: len(f["input_ids"])] for s, f in zip(starts, features, strict=True)],
              [e[: len(f["input_ids"])] for e, f in zip(ends, features, strict=True)])
    assert task.decode(train, features, ragged) == predictions


def test_postprocess_rules(tok):
    task = get_task("squad", n_best=20, max_answer_length=2)
    context = "one two three four five six seven eight"
    ex = task.example("which number?", context)
    [f] = task.features([ex], tok, max_length=64)
    n = len(f["input_ids"])
    pos = {context[o[0]:o[1]]: p for p, o in enumerate(f["offset_mapping"]) if o is not None}
    starts, ends = np.zeros(n), np.zeros(n)
    starts[0] = ends[0] = 50.0          # [CLS] is never an answer
    starts[1] = ends[1] = 40.0          # nor a question token
    starts[pos["two"]], ends[pos["seven"]] = 9.0, 9.0  # too long (6 tokens > 2)
    starts[pos["five"]], ends[pos["four"]] = 8.0, 8.0  # end before start
    ends[pos["six"]] = 7.0              # "five six": the best valid span
    assert task.decode([ex], [f], ([starts], [ends])) == {"0": "five six"}
    nbest = task.nbest([ex], [f], ([starts], [ends]))[0]
    assert nbest[0]["text"] == "five six" and context[nbest[0]["start"]:nbest[0]["end"]] == "five six"
    assert len({a["text"] for a in nbest}) == len(nbest) <= 20
    assert sum(a["probability"] for a in nbest) == pytest.approx(1.0)
    empty = task.example("?", "")
    fe = task.features([empty], tok, max_length=16)
    assert task.decode([empty], fe, ([np.zeros(len(fe[0]["input_ids"]))],) * 2) == {"0": ""}


def test_only_the_max_context_window_may_start_an_answer(tok):
    task = get_task("squad", doc_stride=4, max_query_length=8)
    context = " ".join(str(i) for i in range(100, 140))
    ex = task.example("where?", context)
    features = task.features([ex], tok, max_length=24)
    assert len(features) > 3
    best = [i for i, f in enumerate(features) if any(
        o is not None and context[o[0]:o[1]] == "120" and m
        for o, m in zip(f["offset_mapping"], f["token_is_max_context"], strict=True))]
    assert len(best) == 1
    # the max-context window says "120" (score 10); the others say "120 121" (12), but may not start there
    starts, ends = [], []
    for i, f in enumerate(features):
        s = np.zeros(len(f["input_ids"]))
        e = np.zeros(len(f["input_ids"]))
        for p, o in enumerate(f["offset_mapping"]):
            word = context[o[0]:o[1]] if o is not None else None
            if word == "120":
                s[p] = 5.0 if i in best else 6.0
                e[p] = 5.0 if i in best else 0.0
            if word == "121" and i not in best:
                e[p] = 6.0
        starts.append(s)
        ends.append(e)
    assert task.decode([ex], features, (starts, ends)) == {"0": "120"}


def test_squad_errors(tmp_path, tok):
    task = get_task("squad")
    with pytest.raises(BertforgeError, match=r"expected train-v1\.1\.json"):
        task.read(tmp_path, "train")
    bad = {"data": [{"title": "t", "paragraphs": [{"context": "The cat sat.", "qas": [
        {"id": "q-bad", "question": "Who?", "answers": [{"text": "dog", "answer_start": 4}]}]}]}]}
    (tmp_path / "train-v1.1.json").write_text(json.dumps(bad))
    with pytest.raises(BertforgeError, match=r"question q-bad: answer 'dog' does not occur in its context"):
        task.read(tmp_path, "train")
    assert task.read(tmp_path / "train-v1.1.json", "dev")[0].answer_start is None  # dev: only scored by text
    moved = {"data": [{"title": "t", "paragraphs": [{"context": "The cat sat. The cat ran.", "qas": [
        {"id": "q-off", "question": "Who?", "answers": [{"text": "cat", "answer_start": 15}]}]}]}]}
    (tmp_path / "train-v1.1.json").write_text(json.dumps(moved))
    assert task.read(tmp_path, "train")[0].answer_start == 17  # a wrong offset snaps to the nearest match
    v2 = {"data": [{"title": "t", "paragraphs": [{"context": "x", "qas": [
        {"id": "q-v2", "question": "?", "answers": [], "is_impossible": True}]}]}]}
    (tmp_path / "train-v1.1.json").write_text(json.dumps(v2))
    with pytest.raises(BertforgeError, match="question q-v2 has no answer"):
        task.read(tmp_path, "train")
    (tmp_path / "train-v1.1.json").write_text('{"data": [')
    with pytest.raises(BertforgeError, match=r"train-v1\.1\.json:1: not valid JSON"):
        task.read(tmp_path, "train")
    (tmp_path / "train-v1.1.json").write_text("\n")
    with pytest.raises(BertforgeError, match=r"train-v1\.1\.json is empty"):
        task.read(tmp_path, "train")
    (tmp_path / "train-v1.1.json").write_text('{"version": "1.1"}')
    with pytest.raises(BertforgeError, match="no top-level 'data' list"):
        task.read(tmp_path, "train")
    with pytest.raises(BertforgeError, match="leaves no room for the context"):
        task.features([task.example("a long question " * 30, "ctx")], tok, max_length=32)


def test_round_trip_with_a_tiny_cased_vocab(tmp_path):
    """A vocabulary trained on the fixture itself splits most words into many pieces; answers still map
    back exactly, through every window."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CONTEXT_1 + "\n\n" + CONTEXT_2 + "\n")
    tiny = Tokenizer.train(corpus, VocabOptions(vocab_size=120, lowercase=False), show_progress=False)
    (tmp_path / "train-v1.1.json").write_text(json.dumps(SQUAD))
    task = get_task("squad", doc_stride=7, max_query_length=10)
    train = task.read(tmp_path, "train")
    features = task.features(train, tiny, max_length=48)
    hits = set()
    for f in features:
        if f["start_positions"]:
            ex = train[f["example_index"]]
            off = f["offset_mapping"]
            assert ex.context[off[f["start_positions"]][0]:off[f["end_positions"]][1]] == ex.answer_text
            hits.add(ex.id)
    assert hits == {ex.id for ex in train}
    assert task.decode(train, features, _gold_logits(features, 48)) == {ex.id: ex.answer_text for ex in train}
