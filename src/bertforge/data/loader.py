"""Pretraining batches from prepared shards: NSP instances and MLM masks made at training time.

    data = PretrainingData("data/", "train", DataOptions(seed=12345), rank=0, world_size=1)
    it = data.batches(32)                      # infinite; it.position is where the next batch starts
    batch = next(it)                           # dict of torch tensors, see `collate`
    it = data.batches(32, position=saved)      # resumes exactly where `saved = it.position` was taken

The stream of one epoch e, a pure function of (seed, e) and the data (not of rank, world size or workers):
documents in a random order; cut into blocks of about `BLOCK_TOKENS`; each block's instances (from
`create_instances`, one RNG per document) shuffled within the block. Instance i of the epoch is masked with
random numbers keyed on (seed, e, i), a whole batch at once (`masking.mask_batch`; whole-word masking one
instance at a time). Rank r of W takes instances r, r+W, r+2W, ... and an epoch's last incomplete
round of W is dropped, so every rank has the same number per epoch; DataLoader workers split the rank's
batches round-robin, which is the order DataLoader returns them in, so the batches are the same for any
`num_workers`. The position {"epoch": e, "position": p} counts instances of the whole epoch stream, so it is
the same on every rank. With `dupe_factor` (static masking) epoch e replays epoch e % dupe_factor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from bertforge.data.instances import Instance, create_instances, create_single_segment_instances
from bertforge.data.masking import IGNORE_INDEX, instance_keys, mask_batch, mask_tokens
from bertforge.data.padding import pad_ids, pad_rows
from bertforge.data.shards import Shard, open_split, read_manifest
from bertforge.errors import BertforgeError
from bertforge.options import DataOptions
from bertforge.tokenizer import Tokenizer

BLOCK_TOKENS = 1 << 20  # instances are shuffled within blocks of about this many corpus tokens
_ORDER, _DOC, _BLOCK, _MASK = 0, 1, 2, 3  # RNG streams


def default_max_predictions(max_seq_len: int, masked_lm_prob: float = 0.15) -> int:
    """The cap on masked positions per sequence: the expected count plus 1/24 headroom, which is the paper's
    20 at length 128 and 80 at 512 for a 15% rate (and scales with the rate: 54 at 128 for 40%)."""
    return max(1, math.ceil(round(max_seq_len * masked_lm_prob * 25 / 24, 6)))


class Documents:
    """The documents of one split across its shards, by global index."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards
        counts = [s.n_documents for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.n = int(self.starts[-1])
        self._token_counts: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, g: int) -> list[np.ndarray]:
        k = int(np.searchsorted(self.starts, g, side="right")) - 1
        return self.shards[k].document(g - int(self.starts[k]))

    def word_counts(self, vocab_size: int, max_tokens: int = 50_000_000) -> np.ndarray:
        """(vocab_size,) int64: how often each token id occurs in the split's first `max_tokens` tokens (a fixed
        prefix, so every process and every resume counts the same; about a second per 100 million tokens)."""
        counts, left = np.zeros(vocab_size, np.int64), max_tokens
        for shard in self.shards:
            tokens = shard._tokens[:left]
            counts += np.bincount(tokens, minlength=vocab_size)[:vocab_size]
            left -= len(tokens)
            if left <= 0:
                break
        return counts

    def token_counts(self) -> np.ndarray:
        """(n,) tokens per document."""
        if self._token_counts is None:
            parts = [s.document_token_counts() for s in self.shards]
            self._token_counts = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._token_counts


def collate(instances: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]], pad_id: int) -> dict[str, Any]:
    """Stack masked instances (input_ids, labels, token_type_ids, is_random_next), padded on the right to the
    longest in the batch. Returns torch tensors: input_ids, token_type_ids, attention_mask (1 = real token,
    0 = padding), mlm_labels (-100 = not predicted) all (B, T) int64; nsp_labels (B,) int64, 0 = IsNext,
    1 = NotNext."""
    input_ids, attention = pad_ids([x[0] for x in instances], pad_id)
    return {"input_ids": input_ids, "token_type_ids": pad_rows([x[2] for x in instances], 0),
            "attention_mask": attention, "mlm_labels": pad_rows([x[1] for x in instances], IGNORE_INDEX),
            "nsp_labels": torch.tensor([int(x[3]) for x in instances], dtype=torch.long)}


class PretrainingData:
    """Prepared data of one split, turned into masked NSP instances and batches (see the module docstring).

    `options` says how instances and masks are made (default: DataOptions(), the paper's); its eval_batches and
    num_workers are the training's, not read here. `max_seq_len` defaults to the manifest's; `tokenizer` to the
    one saved with the data."""

    def __init__(self, data_dir: str | Path, split: str = "train", options: DataOptions | None = None, *,
                 max_seq_len: int | None = None, rank: int = 0, world_size: int = 1, tokenizer: Any = None):
        o = options if options is not None else DataOptions()
        self.data_dir = Path(data_dir)
        self.manifest = read_manifest(self.data_dir)
        self.split = split
        self.max_seq_len = int(max_seq_len or self.manifest["max_seq_len"])
        if self.max_seq_len < 8:
            raise BertforgeError(f"max_seq_len {self.max_seq_len} is too small: use at least 8")
        if not 0 <= rank < world_size:
            raise BertforgeError(f"rank {rank} is not in [0, world_size={world_size})")
        if o.dupe_factor is not None and o.dupe_factor < 1:
            raise BertforgeError(f"dupe_factor {o.dupe_factor} must be at least 1 (or None for dynamic masking)")
        if not 0.0 < o.masked_lm_prob < 1.0:
            raise BertforgeError(f"masking rate {o.masked_lm_prob} must be in (0, 1), e.g. 0.15 (the paper) or 0.4")
        self.short_seq_prob, self.masked_lm_prob, self.nsp = o.short_seq_prob, o.masked_lm_prob, o.nsp
        self.max_predictions = int(o.max_predictions_per_seq or default_max_predictions(self.max_seq_len,
                                                                                          o.masked_lm_prob))
        self.whole_word_mask, self.dupe_factor, self.seed = o.whole_word_mask, o.dupe_factor, o.seed
        self.rank, self.world_size = rank, world_size
        self.documents = Documents(open_split(self.data_dir, split, self.manifest))
        if len(self.documents) == 0:
            raise BertforgeError(f"the {split} split of {self.data_dir} has no documents: "
                                 "prepare with more text or a larger --val-fraction")
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.check_tokenizer(self.tokenizer.fingerprint)
        tok = self.tokenizer
        self.pad_id, self.cls_id, self.sep_id, self.mask_id = tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id
        self.is_special = np.zeros(tok.vocab_size, bool)
        self.is_special[list(tok.special_ids)] = True
        self.replacement_ids = np.flatnonzero(~self.is_special)
        self.is_subword = np.asarray(tok.is_subword, bool) if o.whole_word_mask else None

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.manifest["tokenizer_fingerprint"]

    def _load_tokenizer(self) -> Any:
        path = self.data_dir / "tokenizer"
        if not path.is_dir():
            raise BertforgeError(f"{path} is missing: prepare the data again")
        return Tokenizer.from_pretrained(path)

    def check_tokenizer(self, fingerprint: str) -> None:
        """Refuse a model or tokenizer other than the one the shards were made with."""
        if fingerprint != self.tokenizer_fingerprint:
            raise BertforgeError(
                f"{self.data_dir} was prepared with tokenizer {self.tokenizer_fingerprint}, not {fingerprint}: "
                "prepare the corpus again with this model's tokenizer")

    # -- the epoch stream -------------------------------------------------------------------------------
    def _data_epoch(self, epoch: int) -> int:
        return epoch % self.dupe_factor if self.dupe_factor else epoch

    def epoch_instances(self, epoch: int) -> Iterator[Instance]:
        """Every instance of `epoch` (all ranks), unmasked, in stream order."""
        e = self._data_epoch(epoch)
        docs = self.documents
        order = np.random.default_rng([self.seed, e, _ORDER]).permutation(len(docs))
        ends = np.cumsum(docs.token_counts()[order])
        cuts = np.searchsorted(ends, np.arange(BLOCK_TOKENS, int(ends[-1]), BLOCK_TOKENS), side="left") + 1
        for b, block in enumerate(np.split(order, np.unique(cuts))):
            found: list[Instance] = []
            for g in block:
                g = int(g)
                rng = np.random.default_rng([self.seed, e, _DOC, g])
                if self.nsp:
                    found.extend(create_instances(docs[g], g, len(docs), docs.__getitem__, rng,
                                                  max_seq_len=self.max_seq_len, short_seq_prob=self.short_seq_prob))
                else:
                    found.extend(create_single_segment_instances(docs[g], rng, max_seq_len=self.max_seq_len,
                                                                 short_seq_prob=self.short_seq_prob))
            perm = np.random.default_rng([self.seed, e, _BLOCK, b]).permutation(len(found))
            for j in perm:
                yield found[j]

    def mask(self, instance: Instance, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """(input_ids (T,), mlm_labels (T,), token_type_ids (T,), is_random_next) for instance `index` of
        `epoch`: `[CLS] A [SEP] B [SEP]`, token types 0 for `[CLS] A [SEP]` and 1 for `B [SEP]`; a single-segment
        instance (B empty, no NSP) is `[CLS] A [SEP]`. The same as its row of any batch `masked_batch` makes."""
        if self.is_subword is not None:
            ids, types = self._unmasked(instance)
            rng = np.random.default_rng([self.seed, self._data_epoch(epoch), _MASK, index])
            masked, labels = mask_tokens(ids, rng, is_special=self.is_special, mask_id=self.mask_id,
                                         replacement_ids=self.replacement_ids, masked_lm_prob=self.masked_lm_prob,
                                         max_predictions=self.max_predictions, is_subword=self.is_subword)
            return masked, labels, types, instance.is_random_next
        out = self.masked_batch([(epoch, index, instance)])
        n = int(out["attention_mask"].sum())
        return (out["input_ids"][0, :n].numpy(), out["mlm_labels"][0, :n].numpy(),
                out["token_type_ids"][0, :n].numpy(), bool(out["nsp_labels"][0]))

    def _unmasked(self, instance: Instance) -> tuple[np.ndarray, np.ndarray]:
        a, b = instance.tokens_a, instance.tokens_b
        tail = [b, [self.sep_id]] if len(b) else []
        ids = np.concatenate([[self.cls_id], a, [self.sep_id], *tail]).astype(np.int64)
        types = np.zeros(len(ids), np.int64)
        types[len(a) + 2:] = 1
        return ids, types

    def masked_batch(self, batch: list[tuple[int, int, Instance]]) -> dict[str, Any]:
        """The collated batch (see `collate`) of (epoch, index, instance) triples, masked. Without whole-word
        masking all rows at once (`masking.mask_batch`, each instance keyed on (seed, epoch, index))."""
        if self.is_subword is not None:
            return collate([self.mask(inst, e, i) for e, i, inst in batch], self.pad_id)
        rows = [self._unmasked(inst) for _, _, inst in batch]
        ids, attention = pad_ids([r[0] for r in rows], self.pad_id)
        keys = instance_keys(self.seed, np.array([self._data_epoch(e) for e, _, _ in batch]),
                             np.array([i for _, i, _ in batch]))
        masked, labels = mask_batch(ids.numpy(), attention.sum(1).numpy(), keys, is_special=self.is_special,
                                    mask_id=self.mask_id, replacement_ids=self.replacement_ids,
                                    masked_lm_prob=self.masked_lm_prob, max_predictions=self.max_predictions)
        return {"input_ids": torch.from_numpy(masked), "token_type_ids": pad_rows([r[1] for r in rows], 0),
                "attention_mask": attention, "mlm_labels": torch.from_numpy(labels),
                "nsp_labels": torch.tensor([int(inst.is_random_next) for _, _, inst in batch], dtype=torch.long)}

    def _rank_stream(self, epoch: int, position: int) -> Iterator[tuple[int, int, Instance]]:
        """(epoch, index, instance) of this rank from `position` on, forever; complete rounds of W only."""
        w, r = self.world_size, self.rank
        while True:
            produced = 0
            stream = itertools.islice(self.epoch_instances(epoch), position, None)
            for k, round_ in enumerate(_rounds(stream, w)):
                produced += 1
                yield epoch, position + k * w + r, round_[r]
            if produced == 0 and position == 0:
                raise BertforgeError(f"the {self.split} split of {self.data_dir} makes fewer than {w} instances "
                                     "per epoch: prepare more text or use fewer processes")
            epoch, position = epoch + 1, 0

    def _batch_stream(self, batch_size: int, epoch: int, position: int) -> Iterator[tuple[list, dict]]:
        """(batch of (epoch, index, instance), position after it), forever."""
        stream = self._rank_stream(epoch, position)
        pending = next(stream)
        while True:
            batch = []
            for _ in range(batch_size):
                batch.append(pending)
                pending = next(stream)
            yield batch, {"epoch": pending[0], "position": pending[1] - self.rank}

    def batches(self, batch_size: int, *, epoch_start: int = 0, position: int | dict = 0,
                num_workers: int = 0) -> BatchIterator:
        """An infinite iterator of collated batches (see `collate`); `.position` on it is the resume point
        after the last batch it returned. `position` is an instance count into `epoch_start`, or a dict
        {"epoch": e, "position": p} from `.position`."""
        if batch_size < 1:
            raise BertforgeError(f"batch_size {batch_size} must be at least 1")
        if isinstance(position, dict):
            epoch_start, position = int(position["epoch"]), int(position["position"])
        if position % self.world_size:
            raise BertforgeError(f"position {position} is not a multiple of world_size {self.world_size}: "
                                 "resume with the same number of processes")
        return BatchIterator(self, batch_size, epoch_start, position, num_workers)


def _rounds(stream: Iterator[Instance], w: int) -> Iterator[list[Instance]]:
    while True:
        round_ = list(itertools.islice(stream, w))
        if len(round_) < w:
            return
        yield round_


class _BatchDataset(torch.utils.data.IterableDataset):
    """Worker w of n masks and collates the batches k with k % n == w (all of them without workers)."""

    def __init__(self, data: PretrainingData, batch_size: int, epoch: int, position: int):
        self.data, self.batch_size, self.epoch, self.position = data, batch_size, epoch, position

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, n = (info.id, info.num_workers) if info is not None else (0, 1)
        data = self.data
        stream = data._batch_stream(self.batch_size, self.epoch, self.position)
        for k, (batch, after) in enumerate(stream):
            if k % n != worker:
                continue
            out = data.masked_batch(batch)
            # (B, 2) each instance's (epoch, index) in the stream, the same on any number of ranks (ELECTRA keys its
            # samples on it); the epoch a static-masking epoch replays, so a replayed batch is the same batch
            out["instance"] = torch.tensor([[data._data_epoch(e), i] for e, i, _ in batch], dtype=torch.long)
            out["_position"] = after
            yield out


class BatchIterator:
    """Iterator over batches; `position` ({"epoch": e, "position": p}) is where the next batch starts."""

    def __init__(self, data: PretrainingData, batch_size: int, epoch: int, position: int, num_workers: int):
        self.position = {"epoch": epoch, "position": position}
        dataset = _BatchDataset(data, batch_size, epoch, position)
        if num_workers > 0:
            loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                                 prefetch_factor=2)
            self._it = iter(loader)
        else:
            self._it = iter(dataset)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict:
        batch = next(self._it)
        after = batch.pop("_position")
        self.position = {"epoch": int(after["epoch"]), "position": int(after["position"])}
        return batch

    def state_dict(self) -> dict:
        return dict(self.position)
