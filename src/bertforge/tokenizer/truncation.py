"""Which segment of a pair loses tokens when it is too long: the reference's rule, for the tokenizer and for
pretraining instances (`bertforge.data.instances`, which also picks the end each token comes off)."""

from __future__ import annotations


def longest_first(len_a: int, len_b: int, excess: int) -> tuple[int, int]:
    """Segment lengths after removing `excess` tokens one at a time from the longer segment, B when they are
    equal (Google's `truncate_seq_pair`, transformers' `truncate_sequences`), in closed form: first the longer
    segment is cut down to the shorter, then the rest is halved, the odd token coming from B."""
    if excess <= 0:
        return len_a, len_b
    first = min(abs(len_a - len_b), excess)  # from the longer segment
    rest = excess - first  # now of equal length: B, A, B, A, ...
    if len_a > len_b:
        len_a -= first
    else:
        len_b -= first
    return max(len_a - rest // 2, 0), max(len_b - (rest + 1) // 2, 0)


def truncation_strategy(truncation: bool | str | None, is_pair: bool) -> str | None:
    """"longest_first", "only_second" or None (no truncation) for the `truncation` argument of the encoders."""
    if truncation is True or truncation == "longest_first":
        return "longest_first"
    if truncation is False or truncation is None:
        return None
    if truncation == "only_second":
        if not is_pair:
            raise ValueError("truncation='only_second' needs a pair of texts")
        return "only_second"
    raise ValueError(f"truncation must be True, False, 'longest_first' or 'only_second', not {truncation!r}")


def truncated_lengths(len_a: int, len_b: int | None, max_length: int | None, strategy: str | None,
                      n_special: int) -> tuple[int, int | None]:
    """Segment lengths of a text (len_b None) or pair that fit `max_length` tokens with `n_special` special
    tokens added. longest_first: see `longest_first`; a single text is cut at its end. only_second: all from B."""
    if strategy is None or max_length is None:
        return len_a, len_b
    if max_length < n_special:
        raise ValueError(f"max_length {max_length} leaves no room for the {n_special} special tokens")
    excess = len_a + (len_b or 0) + n_special - max_length
    if excess <= 0:
        return len_a, len_b
    if len_b is None:
        return max(len_a - excess, 0), None
    if strategy == "only_second":
        if excess > len_b:
            raise ValueError(f"cannot truncate only the second segment: removing {excess} tokens needs more "
                             f"than its {len_b}; shorten the first segment or raise max_length")
        return len_a, len_b - excess
    return longest_first(len_a, len_b, excess)
