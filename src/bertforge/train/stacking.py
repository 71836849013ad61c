"""Progressive stacking (Gong et al., 2019, "Efficient Training of BERT by Progressively Stacking"): pretrain a
model of half the depth first, then copy its layers on top of themselves and go on with the full depth.

Why it is here: at small compute the masked-LM spends its first steps on a plateau (predicting word frequencies)
that costs about the same number of *tokens* whatever the model's depth; a half-depth model pays those tokens at
about half the price. On this project's CPU, BERT-mini's budget recipe leaves the plateau after ~8 minutes, a
2-layer model of the same width after ~4.5; stacked into 4 layers it goes on from there
(docs/experiments/budget-pretraining.md).
"""

from __future__ import annotations

from bertforge.config import BertConfig
from bertforge.errors import BertforgeError
from bertforge.heads import BertForPreTraining

HALF_DEPTH_DIR = "half-depth"  # the first stage's run directory, inside the staged run's own


def check_stackable(layers: int | None) -> None:
    """Refuses a depth that cannot be halved (None: not known yet, nothing to check)."""
    if layers is not None and (layers < 2 or layers % 2):
        raise BertforgeError(f"stacking needs an even number of layers (the model has {layers}): use "
                             f"--stack-fraction 0 or a model with an even num_hidden_layers")


def half_depth(config: BertConfig) -> BertConfig:
    """The first stage's config: every size the same but half the layers; refuses an odd depth."""
    check_stackable(config.num_hidden_layers)
    return config.replace(num_hidden_layers=config.num_hidden_layers // 2)


def stack_layers(model: BertForPreTraining) -> BertForPreTraining:
    """A new model of twice `model`'s depth L: layer i and layer i + L both start as copies of `model`'s layer i
    (the paper's stacking: the trained stack placed on top of itself); embeddings, pooler and heads are copied."""
    layers = model.config.num_hidden_layers
    deep = BertForPreTraining(model.config.replace(num_hidden_layers=2 * layers))
    source = model.state_dict()
    state = {}
    for name in deep.state_dict():
        head, sep, rest = name.partition(".layer.")
        if sep and head.endswith("encoder"):
            index, _, tail = rest.partition(".")
            name_in_source = f"{head}.layer.{int(index) % layers}.{tail}"
        else:
            name_in_source = name
        state[name] = source[name_in_source].detach().clone()
    deep.load_state_dict(state)
    return deep
