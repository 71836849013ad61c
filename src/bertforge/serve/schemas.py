"""The bodies the endpoints take, and the checks pydantic's types do not make: the input count (413), the fields a
task needs, valid Unicode and [MASK] (422). Each refusal names the field: `inputs[2].context`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NonEmpty = Field(min_length=1)


class Record(BaseModel):
    """One input of /predict: `text` (and `text_pair`) for classification, regression and tagging; `question` and
    `context` for question answering; `context` and `choices` for multiple choice."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    text_pair: str | None = None
    question: str | None = None
    context: str | None = None
    choices: Annotated[list[str], NonEmpty] | None = None


class PredictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"inputs": "a gorgeous, witty film"}]})
    inputs: str | Record | Annotated[list[str | Record], NonEmpty] = Field(
        description="one input or a list: a text, or a record with the task's fields")


class FillMaskBody(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"inputs": "the [MASK] of the union"}]})
    inputs: str | Annotated[list[str], NonEmpty] = Field(description="a text with [MASK], or a list of them")
    top_k: int = Field(5, ge=1, le=100, description="candidates per [MASK]")


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"inputs": ["a first text", "a second"],
                                                                               "pooling": "mean"}]})
    inputs: str | Annotated[list[str], NonEmpty] = Field(description="a text or a list of texts")
    pooling: Literal["cls", "mean", "pooler"] = "cls"
    normalize: bool = False


class Refused(Exception):
    """A request the server refuses: `status` and a one-line `message` naming the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def as_list(inputs: Any, max_inputs: int) -> tuple[list, bool]:
    """(the inputs as a list, whether one input was given rather than a list); more than max_inputs: 413."""
    single = not isinstance(inputs, list)
    items = [inputs] if single else list(inputs)
    if len(items) > max_inputs:
        raise Refused(413, f"inputs: {len(items)} inputs, more than the {max_inputs} one request may hold "
                           "(send them in several requests, or start the server with a larger --max-inputs)")
    return items, single


def _where(n: int, single: bool, name: str = "") -> str:
    return ("inputs" if single else f"inputs[{n}]") + (f".{name}" if name else "")


def check_text(text: str, where: str) -> str:
    """`text`, if it is valid Unicode (JSON may carry a lone surrogate, "\\ud800", that no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused(422, f"{where}: not valid Unicode (a lone surrogate such as \\ud800)") from None
    return text


def check_masked(texts: list[str], single: bool) -> list[str]:
    for n, text in enumerate(texts):
        check_text(text, _where(n, single))
        if "[MASK]" not in text:
            raise Refused(422, f"{_where(n, single)}: no [MASK] in the text; write [MASK] where a word should be "
                               "predicted")
    return texts


def check_texts(texts: list[str], single: bool) -> list[str]:
    return [check_text(t, _where(n, single)) for n, t in enumerate(texts)]


# The fields of a record each task kind needs (QA also takes text/text_pair for question/context, as predict does).
NEEDS = {"classification": ("text",), "regression": ("text",), "token_classification": ("text",),
         "question_answering": ("question", "context"), "multiple_choice": ("context", "choices")}
ALIASES = {"question": "text", "context": "text_pair"}


def predict_records(items: list, single: bool, kind: str) -> list[dict]:
    """/predict's inputs as the records `Predictor.predict` takes: a text becomes {"text": text}."""
    records = []
    for n, item in enumerate(items):
        if isinstance(item, str):
            record = {"text": check_text(item, _where(n, single))}
        else:
            record = item.model_dump(exclude_none=True)
            for name, value in record.items():
                for m, text in enumerate([value] if isinstance(value, str) else value):
                    check_text(text, _where(n, single, name if isinstance(value, str) else f"{name}[{m}]"))
        for name in NEEDS[kind]:
            alias = ALIASES.get(name) if kind == "question_answering" else None
            if not record.get(name) and not (alias and record.get(alias)):
                raise Refused(422, f"{_where(n, single, name)}: a {kind.replace('_', ' ')} model needs "
                                   f"{' and '.join(NEEDS[kind])} in every input")
        records.append(record)
    return records
