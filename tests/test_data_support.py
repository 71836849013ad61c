"""The helpers of tests/support.py under their old module name, for the tests/test_data_*.py files that still
import them from here; once they import from `support`, this file goes. No tests here."""

from support import (  # noqa: F401
    WORDS,
    binomial_bound,
    make_documents,
    prepared_dir,
    tokenizer,
    tokenizer_dir,
    write_doc_corpus,
    write_lines_corpus,
)
