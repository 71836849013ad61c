"""`distill`: a student trained on a fine-tuned teacher's outputs, one `DistillConfig` a run (config.py).

The run is fine-tuning's (`bertforge.finetune.run.train_task`) with another objective and other features: the
student's own tokenizer cuts the task's training examples and the transfer set (transfer.py) into features, each
carrying the teacher's outputs on its example (teacher.py, computed once and cached), and the loss is objective.py's
T^2 KL plus alpha times the task's loss where there is a label. So it has everything fine-tuning has: the work
directory `<out>.partial/` claimed by one process and put in place whole, checkpoints and `--resume` to the same
bits after a kill, torchrun, bf16, metrics.jsonl and curves, the best model on the task's dev split by its main
metric. The output is an ordinary fine-tuned model directory (task.json, config.json with the labels, the student's
tokenizer), which `predict`, `evaluate`, `serve` and `export` load as they load any; its run_config.json records
the distillation's settings and the teacher outputs' cache key.

With several teachers (`more_teachers`, `--teacher A B ...`) the student learns the mean of their outputs, each
teacher's cached on its own (`teacher.mean_outputs`): an ensemble distilled into one model, as Hinton et al. (2015)
first did.

Checked before anything is written, each in one line: each teacher is a fine-tuned directory of the same task (or a
transformers sequence classifier of another architecture whose id2label names the task's labels: foreign.py), its
labels cover the training data's and are every other teacher's; question answering is refused (the two tokenizers
cut answer spans differently); a transfer corpus only for single-text classification and regression; the student is
a model directory or a preset.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bertforge.config import PRESETS, BertConfig
from bertforge.distill import bag_of_words
from bertforge.distill.config import DistillConfig
from bertforge.distill.foreign import foreign_task, is_foreign
from bertforge.distill.objective import DistillObjective, distill_batch, with_targets
from bertforge.distill.teacher import TeacherOutputs, cache_root, mean_outputs, teacher_outputs
from bertforge.distill.transfer import (
    COMPARED_SNIPPETS,
    SELECTION_C,
    cached_texts,
    median_words,
    most_like,
    selection_key,
    transfer_texts,
)
from bertforge.errors import BertforgeError
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.run import (
    Prepared,
    Training,
    check_out_dir,
    check_reinit,
    head_overrides,
    task_spec,
    train_task,
)
from bertforge.tasks import TextExample, get_task
from bertforge.tasks.runner import MODEL_FOR_KIND, TASK_FILE, load_task
from bertforge.tokenizer import Tokenizer
from bertforge.train import distributed


def distill(config: DistillConfig) -> dict:
    """Distil `config.teacher` into `config.student` on `config.task` (and the transfer set); the best dev student
    ends in `config.out_dir`, an ordinary fine-tuned model directory. Returns what `finetune` returns, plus
    "teacher": the outputs' cache key, whether they came from the cache, and the transfer set's size."""
    check_out_dir(Path(config.out_dir))
    d = distributed.setup(config.options.device)
    try:
        student = _student_config(config)
        p, training, outputs, transfer = _prepare(config, student, d)
        result = train_task(student, p, training)
        return {**result, "teacher": {"outputs": outputs.key, "cached": outputs.cached, "transfer_texts": transfer}}
    finally:
        distributed.teardown()


def _student_config(config: DistillConfig) -> FinetuneConfig:
    """The student's fine-tuning run: from its directory, or (a preset) from random weights."""
    options = config.options
    if _is_preset(config.student):
        if options.reinit_layers:
            raise BertforgeError(f"--reinit-layers {options.reinit_layers}: the preset student {config.student} starts "
                                 "from random weights already: drop --reinit-layers")
        options = dataclasses.replace(options, from_scratch=True)
    elif not (Path(config.student) / "config.json").is_file():
        raise BertforgeError(f"--student {config.student} is neither a model directory (config.json, weights, "
                             f"vocab.txt) nor a preset ({', '.join(PRESETS)}): give one of them")
    return FinetuneConfig(task=config.task, data_dir=config.data_dir, init=config.student, out_dir=config.out_dir,
                          task_options=config.task_options, options=options, resume=config.resume)


def _is_preset(student: str) -> bool:
    return student in PRESETS and not Path(student).exists()


def _teacher_task(config: DistillConfig, teacher_dir: str, task: Any) -> Any:
    """The teacher's task (task.json), refused unless it is a fine-tuned model of `task`."""
    teacher = Path(teacher_dir)
    if not teacher.is_dir():
        raise BertforgeError(f"--teacher {teacher} is not a directory: give a fine-tuned model directory (the --out "
                             "of `bertforge finetune`)")
    if is_foreign(teacher):
        if _is_preset(config.student):
            raise BertforgeError(f"--student {config.student}: a preset student takes the teacher's tokenizer, and "
                                 f"{teacher} is a transformers model with a tokenizer of its own: give a pretrained "
                                 "student directory")
        return foreign_task(teacher, task)
    if not (teacher / TASK_FILE).is_file():
        raise BertforgeError(f"--teacher {teacher} has no {TASK_FILE} and is no transformers sequence classifier: it "
                             f"is not fine-tuned; fine-tune it on the task first (`bertforge finetune --init {teacher} "
                             "...`) and pass that --out")
    teacher_task, _ = load_task(teacher)  # task.json checked as predict checks it
    if teacher_task.name != task.name or teacher_task.kind != task.kind:
        raise BertforgeError(f"--teacher {teacher} was fine-tuned on {teacher_task.name} ({teacher_task.kind}), not "
                             f"--task {task.name} ({task.kind}): give a teacher of this task")
    return teacher_task


def _check_labels(task: Any, teacher_tasks: list, config: DistillConfig) -> list[list[int] | None]:
    """The student learns the first teacher's label set, in its order: the training data may not have another label,
    nor another teacher another set. Returns, per teacher, where its outputs hold each of those labels (None: in
    that order, or a task without labels)."""
    if task.kind not in ("classification", "token_classification"):
        return [None] * len(teacher_tasks)
    theirs, ours = list(teacher_tasks[0].labels or []), list(task.labels or [])
    unknown = [label for label in ours if label not in theirs]
    if unknown:
        raise BertforgeError(f"the teacher's labels ({', '.join(theirs)}) lack {', '.join(unknown)} of the training "
                             f"data in {config.data_dir}: give a teacher fine-tuned on this data's labels")
    task.labels = theirs
    orders: list[list[int] | None] = []
    for teacher, teacher_task in zip(config.teachers, teacher_tasks, strict=True):
        labels = list(teacher_task.labels or [])
        if sorted(labels) != sorted(theirs):
            raise BertforgeError(f"--teacher {teacher}'s labels ({', '.join(labels)}) are not {config.teacher}'s "
                                 f"({', '.join(theirs)}): give teachers fine-tuned on the same labels")
        orders.append(None if labels == theirs else [labels.index(label) for label in theirs])
    return orders


# The transfer set's sample does not follow the student's --seed: students of several seeds learn from the same
# texts, which the teacher labels once (one cache entry); with the seed, each seed paid the teacher again.
TRANSFER_SEED = 0
# --transfer-select task-like: the candidates, a uniform sample of up to this many times --max-transfer-texts (the
# measured runs kept 40,000 of 267,000-368,000 snippets; a larger corpus is sampled first, to bound time and memory).
CANDIDATES = 10


def _transfer(config: DistillConfig, task: Any, train: list) -> list[TextExample]:
    """The transfer set as unlabelled examples; refused for a task whose inputs are not single texts."""
    if not config.transfer:
        return []
    if task.kind not in ("classification", "regression") or any(ex.text_pair is not None for ex in train):
        kind = "sentence-pair" if task.kind in ("classification", "regression") else task.kind.replace("_", " ")
        raise BertforgeError(f"--transfer-corpus: {task.name} is a {kind} task, whose inputs plain text cannot stand "
                             "for: leave out --transfer-corpus (it distils on the task's own examples)")
    o = config.distill
    task_texts = [ex.text for ex in train]
    words = o.transfer_words or median_words(task_texts)
    like = o.transfer_select == "task-like"
    limit = o.max_transfer_texts * (CANDIDATES if like else 1)

    def select() -> list[str]:
        texts = transfer_texts(config.transfer, words=words, limit=limit, seed=TRANSFER_SEED, exclude=task_texts)
        return most_like(task_texts, texts, o.max_transfer_texts, seed=TRANSFER_SEED) if like else texts
    settings = {"words": words, "limit": limit, "keep": o.max_transfer_texts, "select": o.transfer_select,
                "seed": TRANSFER_SEED, **({"compared": COMPARED_SNIPPETS, "c": SELECTION_C} if like else {})}
    key = selection_key(config.transfer, task_texts, settings)
    texts = cached_texts(cache_root(config.cache_dir) / "transfer-sets" / f"{key}.txt", select)
    return [TextExample(id=f"transfer-{i}", text=t, source=f"--transfer-corpus snippet {i}")
            for i, t in enumerate(texts)]


def _label(config: DistillConfig, examples: list, teacher_tasks: list, orders: list) -> TeacherOutputs:
    """The teachers' outputs on `examples` (their mean, with several), each computed into the cache or found there."""
    return mean_outputs([teacher_outputs(teacher, examples, config.distill, task=teacher_task,
                                         device=config.options.device, cache=config.cache_dir,
                                         progress=config.options.progress)
                         for teacher, teacher_task in zip(config.teachers, teacher_tasks, strict=True)], orders)


def _teacher(config: DistillConfig, examples: list, teacher_tasks: list, orders: list,
             d: distributed.Dist) -> TeacherOutputs:
    """The teachers' outputs: the main process computes them (or finds them cached), the others then read them from
    the cache."""
    def label() -> TeacherOutputs:
        return _label(config, examples, teacher_tasks, orders)

    outputs = distributed.main_decides(label, d, "the teacher's outputs were refused (see the main process's error)")
    distributed.barrier(d)
    return outputs if d.is_main else label()


def teacher_pass(config: DistillConfig) -> TeacherOutputs:
    """The teachers' outputs over what `config`'s student learns from (the task's training examples and the transfer
    set), computed into the cache or found there, the inputs checked as `distill` checks them: what a caller that
    runs several students of these inputs at once (the demo's seeds) computes first, so that no two compute them."""
    _, teacher_tasks, train, orders, dev, transfer = _examples(config)
    if config.distill.blend_bag_of_words:
        _label(config, dev, teacher_tasks, orders)
    return _label(config, [*train, *transfer], teacher_tasks, orders)


def _examples(config: DistillConfig) -> tuple[Any, list, list, list, list, list[TextExample]]:
    """The task, the teachers' tasks, its training examples, where each teacher holds its labels, its dev examples
    and the transfer set, each read and checked."""
    task = get_task(config.task, **config.task_options)
    if task.kind == "question_answering":
        raise BertforgeError(f"distill: question answering ({task.name}) is not supported yet: the teacher's and the "
                             "student's tokenizers cut answer spans differently; fine-tune the student with "
                             "`bertforge finetune`")
    if config.distill.blend_bag_of_words:
        bag_of_words.check_task(task)
    teacher_tasks = [_teacher_task(config, teacher, task) for teacher in config.teachers]
    train = task.read_train(config.data_dir, config.options.max_train_examples)
    orders = _check_labels(task, teacher_tasks, config)
    dev = task.read(config.data_dir, "dev")
    return task, teacher_tasks, train, orders, dev, _transfer(config, task, train)


def _prepare(config: DistillConfig, student: FinetuneConfig, d: distributed.Dist
             ) -> tuple[Prepared, Training, TeacherOutputs, int]:
    """Every input read and checked, the teacher's outputs computed or found, before anything is written."""
    o = student.options
    task, teacher_tasks, train, orders, dev, transfer = _examples(config)
    preset = _is_preset(config.student)
    tokenizer = Tokenizer.from_pretrained(config.teacher if preset else config.student)
    if not preset:
        check_reinit(o, config.student)
    max_length = o.max_length or task.max_length
    labels = task.labels if task.kind in ("classification", "token_classification") else None
    label_map = task.label_map() if labels else None
    examples = [*train, *transfer]
    outputs = _teacher(config, examples, teacher_tasks, orders, d)
    blend: dict = {}
    if config.distill.blend_bag_of_words:
        teacher_dev = np.stack(_teacher(config, dev, teacher_tasks, orders, d).outputs)
        logits, blend = bag_of_words.blended(np.stack(outputs.outputs), teacher_dev, label_map, (train, transfer, dev))
        outputs = dataclasses.replace(outputs, outputs=list(logits))
        if d.is_main:
            print(bag_of_words.described(blend), flush=True)
    features = with_targets(task.features(examples, tokenizer, max_length, label_map), outputs.outputs, task.kind)
    dev_features = task.features(dev, tokenizer, max_length, label_map, windows=o.windows)
    task.references(dev)  # a dev split without gold answers fails now, not after the first epoch
    p = Prepared(task, tokenizer, examples, dev, features, dev_features, max_length, labels,
                 task_spec(task, config.task_options, max_length))
    model = (lambda: _preset_student(config.student, task, labels, tokenizer.vocab_size, o.seed)) if preset else None
    recorded = {"options": {**dataclasses.asdict(o), **dataclasses.asdict(config.distill)},
                "teacher": {"dir": config.teacher, "outputs": outputs.key,
                            **({"members": [{"dir": t, "outputs": k} for t, k in zip(
                                config.teachers, outputs.manifest["members"], strict=True)]}
                               if config.more_teachers else {}), **({"bag_of_words": blend} if blend else {})},
                "student": config.student,
                "transfer": {"corpus": list(config.transfer), "texts": len(transfer)}}
    training = Training(DistillObjective(task.kind, config.distill.temperature, config.distill.alpha),
                        collate=distill_batch, model=model, run_config=recorded, command="distill")
    return p, training, outputs, len(transfer)


def _preset_student(preset: str, task: Any, labels: list | None, vocab_size: int, seed: int) -> torch.nn.Module:
    """A student of the preset's size with random weights (seeded), over the teacher's vocabulary."""
    torch.manual_seed(seed)
    config = BertConfig.from_preset(preset, vocab_size=vocab_size).replace(**head_overrides(task, labels))
    return MODEL_FOR_KIND[task.kind](config)
