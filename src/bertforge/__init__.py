"""bertforge: train BERT end to end, from raw text to a WordPiece vocabulary, MLM + NSP pretraining,
fine-tuned task models and fast inference.

Names are imported lazily, so `import bertforge` and `bertforge --help` do not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "BertConfig": "bertforge.config",
    "BertModel": "bertforge.encoder",
    "BertForPreTraining": "bertforge.models",
    "BertForMaskedLM": "bertforge.models",
    "BertForSequenceClassification": "bertforge.models",
    "BertForTokenClassification": "bertforge.models",
    "BertForQuestionAnswering": "bertforge.models",
    "BertForMultipleChoice": "bertforge.models",
    "Tokenizer": "bertforge.tokenizer",
    "BertforgeError": "bertforge.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bertforge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
