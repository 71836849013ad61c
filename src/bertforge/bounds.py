"""The values a numeric option may take (`Bound`), and the bounds the options share, each with the reason it gives.

Every numeric option has an upper end too, generous: far past any real run, so that a value above it is a typo (an
extra zero, seconds for minutes, 1e30) refused in one line, not a run planned for centuries or a terabyte allocation.
Like `bertforge.options`, which declares the options with them, this module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """The values a numeric option may take: `lo` and `hi` (None: unbounded), each included unless `*_open`;
    `why` is added to the refusal. No bound admits nan or an infinity, whatever its ends."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def describe(self) -> str:
        lo, hi = _shown(self.lo), _shown(self.hi)
        if self.hi is None:
            return f"above {lo}" if self.lo_open else f"at least {lo}"
        if self.lo is None:
            return f"below {hi}" if self.hi_open else f"at most {hi}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"

    def because(self, why: str) -> Bound:
        return dataclasses.replace(self, why=why)

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):  # nan compares False, inf passes a missing end
            return False
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below


def _shown(n: float | None) -> str:
    """A bound's end as a user types it: 1_048_576 for 2**20 (int() and float() read the underscores)."""
    return f"{n:_}" if isinstance(n, int) and abs(n) >= 10**6 else str(n)


def at_least(n: int, why: str = "", *, at_most: float | None = None) -> Bound:
    return Bound(lo=n, hi=at_most, why=why)


MAX_STEPS = 10**9  # optimizer steps, and what is counted in them (warmup, intervals): years at any speed
MAX_BATCH = 2**20  # sequences in one batch or forward pass
MAX_SEQ_LEN = 2**16  # tokens in a sequence (BERT: 512); attention over more fits no device
MAX_MINUTES = 366 * 24 * 60  # a year, as pretrain --minutes (`bertforge.pretrain.config.MAX_MINUTES`)

PROBABILITY = Bound(lo=0, hi=1, lo_open=True, hi_open=True)  # a share that must leave some of both sides
FRACTION = Bound(lo=0, hi=1, hi_open=True)  # a share that may be zero but not all (dropout, warmup, held out)
SHARE = Bound(lo=0, hi=1, lo_open=True)  # a share of something that may be all of it but not none
MIN_SEQ_LEN = at_least(8, "8: the least `prepare` makes instances for; attention over more than 2**16 tokens fits no "
                          "device", at_most=MAX_SEQ_LEN)  # a sequence length
SEED = Bound(lo=0, hi=2**32 - 1, why="a seed is a 32-bit number")
LEARNING_RATE = Bound(lo=0, hi=10, lo_open=True, why="a learning rate above 10 diverges")
BATCH = at_least(1, "more than 2**20 sequences at once fit no device", at_most=MAX_BATCH)
EPOCHS = Bound(lo=0, hi=10**4, lo_open=True, why="more than 10,000 epochs is a typo")
MINUTES = at_least(0, "0: off; a year at most", at_most=MAX_MINUTES)
KEPT_CHECKPOINTS = at_least(1, "the last checkpoint is what --resume needs; a million at most", at_most=10**6)
EXAMPLES = at_least(1, "more than 10**12 examples is more than any data set holds", at_most=10**12)
WINDOWS = at_least(1, "1: only a text's first tokens; a text read in more than 1,000 windows is a book", at_most=1000)
VOCAB_SIZE = at_least(6, "the 5 special tokens and at least one piece; 2**22 at most, ten times the largest "
                         "vocabulary in use", at_most=2**22)


def step_count(lo: int) -> Bound:
    """A number of optimizer steps or an interval counted in them, from `lo` up to MAX_STEPS."""
    return at_least(lo, "more than 10**9 steps is years of training at any speed: a typo", at_most=MAX_STEPS)
