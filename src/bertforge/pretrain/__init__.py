"""Pretraining: the recipes, what a time budget buys, stacking, the objectives (masked-LM with its sampled softmax,
a bag of words on [CLS], ELECTRA's replaced-token detection) and co-occurrence embeddings, run through the one
training loop of `bertforge.train`.

    from bertforge.pretrain import pretrain, recipe_config
    pretrain(recipe_config("budget", data="data/", out="runs/tiny", model="tiny", minutes=30))

The names are loaded when first used, so that `bertforge.pretrain.config` and `.recipe` (standard library only)
can be imported by the command line without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"pretrain": "run", "resolve_model_config": "run", "PretrainConfig": "config", "recipe_config": "recipe",
            "RECIPES": "recipe"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
