"""SQuAD v1.1 extractive question answering: the official JSON, sliding-window features, post-processing.

Files: train-v1.1.json and dev-v1.1.json in a directory, or one JSON file for any split. Features follow the
original BERT algorithm, with character offsets instead of whitespace tokens:

- the question is tokenized and cut to `max_query_length` (64) tokens;
- the context is tokenized once and covered by windows of `max_length - len(question) - 3` tokens that start
  `doc_stride` (128) tokens apart: [CLS] question [SEP] window [SEP];
- the answer's token span comes from the offsets; a window that does not hold the whole answer points at
  [CLS] (position 0) for training;
- each context token is scored in the window where it has the most context on both sides
  ("token_is_max_context"); only there may a predicted answer start.

Post-processing (decode) takes the `n_best` (20) highest start and end logits of every window, keeps pairs
inside the context, starting at a max-context token, at most `max_answer_length` (30) tokens long, and
returns the best-scoring one (start + end logit) over all windows as the exact characters of the original
context. Scores: exact match and F1 by the official v1.1 rules.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bertforge.errors import BertforgeError
from bertforge.files import open_text
from bertforge.tasks.base import Feature, QAExample, Task, split_file
from bertforge.tasks.features import encode_plain
from bertforge.tasks.metrics import squad_scores

_FILES = {"train": ["train-v1.1.json"], "dev": ["dev-v1.1.json"], "test": ["test-v1.1.json"]}


def _locate(context: str, text: str, start: Any) -> int | None:
    """The character where `text` is in `context`: `start` when it is right, else the nearest occurrence."""
    if isinstance(start, int) and context[start:start + len(text)] == text:
        return start
    hits, pos = [], context.find(text)
    while pos != -1 and text:
        hits.append(pos)
        pos = context.find(text, pos + 1)
    if not hits:
        return None
    return min(hits, key=lambda h: abs(h - start)) if isinstance(start, int) else hits[0]


_ID = re.compile(r'"id"\s*:\s*("(?:[^"\\]|\\.)*")')


def _id_lines(text: str) -> dict[str, int]:
    """{question id: line of the file where it is declared}, in one pass, so messages can say file:line."""
    lines, line, pos = {}, 1, 0
    for m in _ID.finditer(text):
        line += text.count("\n", pos, m.start())
        pos = m.start()
        try:
            lines.setdefault(str(json.loads(m.group(1))), line)
        except ValueError:
            continue
    return lines


def read_squad(path: Path, *, require_answers: bool) -> list[QAExample]:
    with open_text(path) as f:
        text = f.read()
    if not text.strip():
        raise BertforgeError(f"{path} is empty: expected the SQuAD v1.1 JSON format")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BertforgeError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); expected the SQuAD v1.1 format") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise BertforgeError(f"{path}: no top-level 'data' list; expected the SQuAD v1.1 JSON format")
    lines = _id_lines(text)
    examples = []
    for article in data["data"]:
        title = article.get("title", "")
        for paragraph in article.get("paragraphs", []):
            context = paragraph.get("context")
            if not isinstance(context, str):
                raise BertforgeError(f"{path}: a paragraph of '{title}' has no 'context' text; fix the file")
            for qa in paragraph.get("qas", []):
                examples.append(_example(qa, context, title, path, require_answers, lines))
    if not examples:
        raise BertforgeError(f"{path} has no questions; expected data[].paragraphs[].qas[] entries")
    return examples


def _example(qa: dict, context: str, title: str, path: Path, require_answers: bool,
             lines: dict[str, int]) -> QAExample:
    qid = str(qa.get("id", ""))
    question = qa.get("question")
    if not qid or not isinstance(question, str):
        raise BertforgeError(f"{path}: a question of '{title}' lacks an 'id' or 'question'; fix the file")
    place = f"{path}:{lines[qid]}" if qid in lines else str(path)
    answers = [a for a in qa.get("answers", []) if isinstance(a, dict) and isinstance(a.get("text"), str)]
    start = text = None
    if answers:
        first = answers[0]
        start = _locate(context, first["text"], first.get("answer_start"))
        text = first["text"] if start is not None else None
    if require_answers:
        if not answers or qa.get("is_impossible"):
            raise BertforgeError(f"{place}: question {qid} has no answer (SQuAD v2.0 unanswerable questions are not "
                                 "supported); remove it or give its answer")
        if start is None:
            raise BertforgeError(f"{place}: question {qid}: answer {answers[0]['text']!r} does not occur in its "
                                 "context; fix the answer text or answer_start, or remove the question")
    return QAExample(id=qid, question=question, context=context, answers=[a["text"] for a in answers],
                     answer_start=start, answer_text=text, title=title, source=f"{place}: question {qid}")


def _windows(n: int, size: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of the context windows: `size` tokens each, starting `stride` apart, up to the end."""
    spans, start = [], 0
    while True:
        length = min(n - start, size)
        spans.append((start, length))
        if start + length >= n:
            return spans
        start += min(length, stride)


def _max_context(spans: list[tuple[int, int]]) -> list[list[bool]]:
    """For each window and token in it: is this the window where the token has the most context?
    Score = min(tokens to the left, tokens to the right) + 0.01 * window length; the first best wins."""
    best: dict[int, tuple[float, int]] = {}
    for w, (start, length) in enumerate(spans):
        for j in range(start, start + length):
            score = min(j - start, start + length - 1 - j) + 0.01 * length
            if j not in best or score > best[j][0]:
                best[j] = (score, w)
    return [[best[j][1] == w for j in range(start, start + length)] for w, (start, length) in enumerate(spans)]


def _answer_tokens(ex: QAExample, offsets: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """First and last context token overlapping the answer's characters (surrounding spaces ignored)."""
    start, end = ex.answer_start, ex.answer_start + len(ex.answer_text)
    while start < end and ex.context[start].isspace():
        start += 1
    while end > start and ex.context[end - 1].isspace():
        end -= 1
    inside = [t for t, (s, e) in enumerate(offsets) if e > s and s < end and e > start]
    return (inside[0], inside[-1]) if inside else None


class SquadTask(Task):
    name = "squad"
    kind = "question_answering"
    main_metric = "f1"
    max_length = 384

    def __init__(self, *, doc_stride: int = 128, max_query_length: int = 64, n_best: int = 20,
                 max_answer_length: int = 30):
        super().__init__(None)
        self.doc_stride = doc_stride
        self.max_query_length = max_query_length
        self.n_best = n_best
        self.max_answer_length = max_answer_length

    @property
    def num_labels(self) -> int:
        return 2  # start and end logits

    def read(self, data_path: str | Path, split: str) -> list[QAExample]:
        return read_squad(split_file(data_path, split, _FILES, self.name), require_answers=split == "train")

    def example(self, question: str, context: str) -> QAExample:
        """An example for prediction."""
        return QAExample(id="0", question=question, context=context, source="<input>")

    def features(self, examples: Sequence[QAExample], tokenizer: Any, max_length: int = 384,
                 label_map: dict[str, int] | None = None, windows: int = 1) -> list[Feature]:
        """Sliding-window features. Each has input_ids, token_type_ids, example_index, example_id,
        offset_mapping ((start, end) characters of the context per token, None outside the context),
        token_is_max_context, and start_positions/end_positions when the example's answer is known."""
        questions = tokenizer.tokenize_ids([ex.question for ex in examples])
        unique = list(dict.fromkeys(ex.context for ex in examples))  # questions share paragraphs
        contexts = {text: (list(enc.ids), [tuple(o) for o in enc.offsets])
                    for text, enc in zip(unique, encode_plain(tokenizer, unique), strict=True)}
        features = []
        for i, (ex, q) in enumerate(zip(examples, questions, strict=True)):
            q = list(q[: self.max_query_length])
            ids, offsets = contexts[ex.context]
            size = max_length - len(q) - 3
            if size < 1:
                raise BertforgeError(f"max_length {max_length} leaves no room for the context after a "
                                     f"{len(q)}-token question; use a larger max length")
            answer = _answer_tokens(ex, offsets) if ex.answer_start is not None else None
            if answer is None and ex.answer_start is not None:
                raise BertforgeError(f"{ex.source}: the answer {ex.answer_text!r} covers no token of the context; "
                                     "fix the answer or remove the question")
            spans = _windows(len(ids), size, self.doc_stride)
            for (start, length), max_context in zip(spans, _max_context(spans), strict=True):
                head = len(q) + 2
                feature: Feature = {
                    "input_ids": [tokenizer.cls_id, *q, tokenizer.sep_id, *ids[start:start + length],
                                  tokenizer.sep_id],
                    "token_type_ids": [0] * head + [1] * (length + 1),
                    "example_index": i,
                    "example_id": ex.id,
                    "offset_mapping": [None] * head + offsets[start:start + length] + [None],
                    "token_is_max_context": [False] * head + max_context + [False],
                }
                if answer is not None:
                    first, last = answer
                    if start <= first and last < start + length:
                        feature["start_positions"] = first - start + head
                        feature["end_positions"] = last - start + head
                    else:
                        feature["start_positions"] = feature["end_positions"] = 0
                features.append(feature)
        return features

    def nbest(self, examples: Sequence[QAExample], features: Sequence[Feature], outputs: Any) -> list[list[dict]]:
        """Per example, up to `n_best` distinct answers, best first: {"text", "start", "end" (characters in
        the context), "score", "probability"}. `outputs` = (start_logits, end_logits), each (N, T) or a list
        of per-feature arrays."""
        start_logits, end_logits = outputs
        by_example: dict[int, list[int]] = defaultdict(list)
        for fi, f in enumerate(features):
            by_example[f["example_index"]].append(fi)
        results = []
        for i, ex in enumerate(examples):
            candidates = []
            for fi in by_example[i]:
                f = features[fi]
                n = len(f["input_ids"])
                starts = _logits(start_logits[fi], n)
                ends = _logits(end_logits[fi], n)
                offsets, max_context = f["offset_mapping"], f["token_is_max_context"]
                top_starts = np.argsort(-starts, kind="stable")[: self.n_best]
                top_ends = np.argsort(-ends, kind="stable")[: self.n_best]
                for s in top_starts:
                    if offsets[s] is None or not max_context[s]:
                        continue
                    for e in top_ends:
                        if offsets[e] is None or e < s or e - s + 1 > self.max_answer_length:
                            continue
                        candidates.append((float(starts[s] + ends[e]), offsets[s][0], offsets[e][1]))
            candidates.sort(key=lambda c: -c[0])
            answers, seen = [], set()
            for score, a, b in candidates:
                text = ex.context[a:b]
                if text in seen:
                    continue
                seen.add(text)
                answers.append({"text": text, "start": a, "end": b, "score": score})
                if len(answers) == self.n_best:
                    break
            if answers:
                scores = np.array([a["score"] for a in answers])
                probs = np.exp(scores - scores.max())
                for a, p in zip(answers, probs / probs.sum(), strict=True):
                    a["probability"] = float(p)
            results.append(answers)
        return results

    def decode(self, examples: Sequence[QAExample], features: Sequence[Feature], outputs: Any) -> dict[str, str]:
        """{question id: answer text} ("" when no valid span exists), the official predictions format."""
        best = self.nbest(examples, features, outputs)
        return {ex.id: (answers[0]["text"] if answers else "") for ex, answers in zip(examples, best, strict=True)}

    def references(self, examples: Sequence[QAExample]) -> dict[str, list[str]]:
        missing = next((ex for ex in examples if not ex.answers), None)
        if missing is not None:
            raise BertforgeError(f"{missing.source}: no answers to score against; evaluate on a split with answers")
        return {ex.id: list(ex.answers) for ex in examples}

    def metric(self, predictions: dict[str, str], references: dict[str, Sequence[str]]) -> dict[str, float]:
        return squad_scores(predictions, references)


def _logits(values: Any, n: int) -> Any:
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=np.float64)[:n]
