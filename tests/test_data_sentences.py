"""The sentence splitter against a hand-labelled set: each case is the expected sentences, joined by spaces
to make the input. Boundary precision and recall are measured over the whole set."""

from __future__ import annotations

import pytest

from bertforge.corpus.sentences import split_sentences

GOLD: list[list[str]] = [
    # abbreviations and titles
    ["Mr. Smith went to Washington.", "He arrived on Tuesday."],
    ["Mrs. Jones and Dr. Brown met Gen. Grant at St. Louis.", "They talked."],
    ["The U.S. Army grew quickly.", "Congress paid for it."],
    ["We trade with the U.S. and Canada.", "Both agreed."],
    ["Relations with the U.S. improved.", "The treaty was signed."],
    ["He worked for Acme Inc. in Ohio.", "Then he moved."],
    ["Bring apples, pears, etc. to the fair.", "It starts at noon."],
    ["See the report, i.e. the one from May.", "It is long."],
    ["The meeting is on Jan. 5 at the hall.", "Please come."],
    ["Read No. 5 and Art. 3 of the act.", "They matter."],
    ["John F. Kennedy spoke in 1961.", "The crowd cheered."],
    ["Prof. Ada E. Lovelace wrote notes.", "They survive."],
    ["The vote was Smith vs. Jones.", "Smith won."],
    # decimals, numbers, money, percentages
    ["Revenue rose 3.5 percent to $1.2 billion.", "Costs fell."],
    ["The rate is 0.75% this year.", "It was 1.25% last year."],
    ["It happened in 1812.", "1813 was worse."],
    ["Version 2.0.1 fixed the bug.", "Users were glad."],
    # quotes and brackets
    ['He said, "Stop."', "Then he left."],
    ['"Is it over?" she asked.', '"Yes."'],
    ["The law (passed in 1890.) was repealed.", "Nobody noticed."],
    ["He shouted \u201cNow!\u201d", "Everyone ran."],
    ["(This is a note.)", "This is not."],
    # ellipses and other terminals
    ["Wait... and then it came.", "Nobody expected it."],
    ["I thought about it\u2026", "Then I agreed."],
    ["Really?!", "Yes, really."],
    ["What now?", "We go on!", "Forward."],
    # things that must not split
    ["Visit www.example.com for details.", "It is free."],
    ["The file is named data.txt in the folder.", "Open it."],
    ["Section 4.2 of the code applies here."],
    ["He earned a Ph.D. in physics and taught."],
    ["It ended at 5 p.m. yesterday evening.", "Everyone went home."],
    # harder: an abbreviation at the end of a sentence, and one before a capitalised name
    ["Prices fell in the U.K.", "Experts disagree."],
    ["They arrived in Washington, D.C.", "The next day they met."],
    ["The Washington, D.C. office opened."],
    ["Talks began in Oct.", "Nothing came of them."],
    ["The U.S. Senate ratified it."],
    ["I met Capt. Ahab and Lt. Dan.", "Both were sailors."],
    ["He was born in Springfield, Ill. in 1850."],
    ["The army had 25,000 men.", "2,000 were sick."],
    # plain prose
    ["The war is over.", "Peace has come.", "We rebuild."],
    ["Fellow-Citizens of the Senate and House of Representatives:"],
    ["To be prepared for war is one of the most effectual means of preserving peace."],
    ["A free people ought not only to be armed, but disciplined.", "Our navy must grow."],
]


def _boundaries(sentences: list[str]) -> set[int]:
    """Character offsets (in the space-joined text) where a new sentence starts, excluding the first."""
    out, pos = set(), 0
    for s in sentences[:-1]:
        pos += len(s) + 1
        out.add(pos)
    return out


def test_splitter_precision_and_recall_on_the_gold_set():
    tp = fp = fn = 0
    wrong = []
    for expected in GOLD:
        got = split_sentences(" ".join(expected))
        assert " ".join(got) == " ".join(expected)  # nothing lost or altered
        e, g = _boundaries(expected), _boundaries(got)
        tp, fp, fn = tp + len(e & g), fp + len(g - e), fn + len(e - g)
        if got != expected:
            wrong.append(got)
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    print(f"splitter: precision {precision:.3f} recall {recall:.3f} ({tp} tp, {fp} fp, {fn} fn); wrong: {wrong}")
    # Measured: precision 1.000, recall 0.947 (misses "the U.K. Experts", "in Oct. Nothing": it prefers
    # a missed boundary to a false one).
    assert precision >= 0.97 and recall >= 0.9, wrong


@pytest.mark.parametrize("text,expected", [
    ("Mr. Smith went to Washington. He arrived.", ["Mr. Smith went to Washington.", "He arrived."]),
    ("Revenue rose 3.5 percent. It fell.", ["Revenue rose 3.5 percent.", "It fell."]),
    ("The U.S. The end.", ["The U.S.", "The end."]),
    ("Wait... and then. Done", ["Wait... and then.", "Done"]),
    ("no terminal at all", ["no terminal at all"]),
    ("  \n ", []),
    ("Line one\nstill one. Two.", ["Line one still one.", "Two."]),
])
def test_splitter_cases(text, expected):
    assert split_sentences(text) == expected


def test_splitter_on_a_real_address(shared_data):
    """On a real address no sentence is cut after a title or an initial, and splitting loses no text."""
    path = sorted((shared_data / "corpus" / "sotu").glob("*.txt"))[100]
    paragraphs = [p for p in path.read_text().split("\n\n") if p.strip()]
    for para in paragraphs:
        sents = split_sentences(para)
        assert " ".join(sents) == " ".join(para.split())
        for s in sents[:-1]:
            last = s.split()[-1]
            assert last.rstrip(".").lower() not in {"mr", "mrs", "dr", "gen", "st"}, s
            assert not (len(last) == 2 and last[0].isupper() and last[1] == "." and last[0] not in "IVX"), s
