"""What the benches measure with: the texts bench/inference.py's uniform workload makes (every side reads the same
tokens only if no text passes the length the other sides cut at; ours reads a text whole), and the model FLOPs
bench/finetune.py's share of the matmul rate counts (bench/train_flops.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


class WordPieces:
    """A stand-in tokenizer: a word of n letters is (n mod 5) + 1 pieces, so words of 1 to 5 pieces mix."""

    @staticmethod
    def tokenize_ids(words: list[str]) -> list[list[int]]:
        return [[0] * (len(w) % 5 + 1) for w in words]

    @staticmethod
    def count(text: str) -> int:
        return 2 + sum(len(w) % 5 + 1 for w in text.split())  # with [CLS] and [SEP]


def test_uniform_texts_never_pass_the_cut_and_spread_over_its_range(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import inference

    reviews = [" ".join("abcdefgh"[: 1 + (i * 7 + j) % 8] for j in range(40)) for i in range(50)]
    texts = inference.uniform_texts(reviews, WordPieces, 400)
    counts = [WordPieces.count(t) for t in texts]
    assert len(texts) == 400 and all(t.strip() for t in texts)
    assert max(counts) <= inference.MAX_LENGTH
    assert min(counts) < 24 and max(counts) > inference.MAX_LENGTH - 6  # the whole range, not one length


def test_fine_tuning_flops_count_every_product_of_a_training_step(monkeypatch):
    """bench/train_flops.py's model FLOPs against torch's FLOP counter over one forward and backward of transformers'
    BERT classifier (eager attention, so its batched products are counted): the same products, counted apart."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.syspath_prepend(str(BENCH))
    import train_flops

    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=40, attn_implementation="eager")
    model = transformers.BertForSequenceClassification(config)
    ids = torch.randint(0, 50, (5, 17))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=torch.zeros(5, dtype=torch.long)).loss.backward()
    counted = train_flops.classifier_flops(32, 48, 3, 2, [[17] * 5])
    assert counted == counter.get_total_flops()
    assert train_flops.classifier_flops(32, 48, 3, 2, [[17] * 5, [9, 9]]) > counted  # every batch adds its own
    ragged = [[17, 17, 17, 17, 9]]  # padded, the short sequence costs what a full one does
    assert train_flops.classifier_flops(32, 48, 3, 2, ragged, padded=True) == counted
    assert train_flops.classifier_flops(32, 48, 3, 2, ragged) < counted


def test_a_students_agreement_is_the_share_of_examples_given_the_teachers_label(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import distill

    assert distill.agreement(["pos", "neg", "pos", "neg"], ["pos", "pos", "pos", "neg"]) == 75.0
    assert distill.agreement(["neg"], ["neg"]) == 100.0
    with pytest.raises(ValueError, match="3 labels against the teacher's 2"):
        distill.agreement(["pos", "neg", "pos"], ["pos", "neg"])


def test_the_teacher_labels_each_sides_inputs_once_before_runs_go_side_by_side(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr("sys.argv", ["distill.py", "--seeds", "2", "--jobs", "2"])
    import distill

    args = distill._args()
    assert args.jobs == 2
    corpus = [str(tmp_path / "reviews.txt")]
    configs = [distill._config(args, side, k, tmp_path / "task", corpus, tmp_path)[1]
               for side in distill.SIDES for k in range(args.seeds)]
    labelled = distill.teacher_inputs(configs)
    # the pretrained and random students read the same transfer text, the task-only side none; fine-tuning no teacher
    assert [c.transfer for c in labelled] == [tuple(corpus), ()]
    assert [Path(c.out_dir).parent.name for c in labelled] == ["rt-distilled", "rt-distilled-task-only"]
