"""The demo's summary in words: the table it prints, the verdict on each task, and report.md."""

from __future__ import annotations

import math
from pathlib import Path

from bertforge.pretrain.isotropy import BANDS, band_key
from bertforge.progress import counted

# Val MLM accuracy below which a budget run is still on the masked-LM's early plateau, where the model guesses
# frequent words whatever the context: 12-14% on State of the Union addresses and movie snippets, rising past 16% as
# it leaves (about 1.3M tokens in the recipe's 16-token first stage, 5M at length 64); on the demo's IMDB reviews a
# 10-minute run that ended at 15.4% still filled masks with punctuation and function words
# (docs/experiments/plateau.md).
PLATEAU_MLM_ACCURACY = 0.16


def _mean_row(name: str, runs: dict) -> tuple[str, str]:
    """A row of the seeds' mean test score and its spread."""
    return name, f"{runs['test_mean']:.1f} ± {runs['test_std']:.1f}"


def _task_rows(title: str, sides: dict, bag_of_words: dict) -> list[tuple[str, str]]:
    pre, scr = sides["pretrained"], sides["scratch"]
    return [
        _mean_row(f"{title} test accuracy, from pretrained (lr {pre['lr']:g}, {counted(pre['epochs'], 'epoch')})",
                  pre),
        _mean_row(f"{title} test accuracy, from random weights (lr {scr['lr']:g}, "
                  f"{counted(scr['epochs'], 'epoch')})", scr),
        (f"pretraining helped by ({counted(len(pre['runs']), 'seed')} each)",
         f"{pre['test_mean'] - scr['test_mean']:+.1f} points"),
        (f"{title} test accuracy, bag of words (no language model)", f"{bag_of_words['test']:.1f}"),
    ]


def _isotropy_rows(iso: dict) -> list[tuple[str, str]]:
    """The pretrained word embeddings' isotropy (pretrain/isotropy.py), a random initialisation's in brackets."""
    pre, init = iso["pretrained"], iso["initial"]
    names = [(band_key(lo, hi), f"word vectors' mean pair cosine, ids {lo}-{hi}") for lo, hi in BANDS]
    names += [("emb_mean_unit_norm", "norm of the mean unit word vector"), ("emb_norm_mean", "mean word vector norm")]
    return [(f"{label} (at init)", f"{_two(pre[key])} ({_two(init[key])})") for key, label in names if key in pre]


def _two(x: float) -> str:
    return f"{x:.2f}".replace("-0.00", "0.00")  # a cosine of -0.004 at initialisation is no negative figure


def table(s: dict) -> str:
    rows = [("pretraining MLM accuracy (val)", f"{100 * s['pretraining']['mlm_accuracy']:.1f}%"),
            *_task_rows("Rotten Tomatoes", s["finetune"], s["bag_of_words"])]
    if "untuned" in s:
        u = s["untuned"]
        rows += _task_rows(f"{u['title']} (untuned)", u["finetune"], u["bag_of_words"])
    if "distill" in s:
        rows += _distill_rows(s)
    if "isotropy" in s:
        rows += _isotropy_rows(s["isotropy"])
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value:>11}" for name, value in rows]
    lines += ["", *verdict(s)]
    lines.append("\nfill-mask (pretrained model, top 3):")
    for item in s["fill_mask"]:
        lines.append(f"  {item['text']:<55} -> {', '.join(item['top'])}")
    return "\n".join(lines)


def verdict(s: dict) -> list[str]:
    """What the summary's figures say, in sentences: on Rotten Tomatoes, and which of its models to deploy when the
    demo distilled one; then on the untuned task when there is one."""
    return (_tuned_verdict(s) + (deploy_verdict(s) if "distill" in s else [])
            + (_untuned_verdict(s["untuned"], s.get("model", "tiny")) if "untuned" in s else []))


def _distill_rows(s: dict) -> list[tuple[str, str]]:
    """The distillation stage's rows: the teacher, the distilled student, and every Rotten Tomatoes model's speed."""
    d = s["distill"]
    student, speed = d["student"], d["texts_per_s"]
    return [
        (f"Rotten Tomatoes test accuracy, teacher MiniLM-L6 fine-tuned (lr {d['teacher']['lr']:g})",
         f"{d['teacher']['test']:.1f}"),
        _mean_row(f"Rotten Tomatoes test accuracy, BERT-{s['model']} distilled from it "
                  f"({counted(len(student['runs']), 'seed')})", student),
        ("texts/s on this CPU, teacher MiniLM-L6 (int8)", f"{speed['teacher']:,.0f}"),
        (f"texts/s on this CPU, BERT-{s['model']} (int8; distilled or fine-tuned alike)", f"{speed['student']:,.0f}"),
        ("texts/s on this CPU, bag of words", f"{s['bag_of_words']['texts_per_s']:,.0f}"),
    ]


def deployed(s: dict) -> str:
    """The Rotten Tomatoes model the summary tells a user to deploy, by test accuracy: "distilled" (the distilled
    student, above bag of words and the same model fine-tuned on the labels alone), else "teacher" where the teacher
    is above bag of words; without a distillation stage "finetuned" (the pretrained model fine-tuned) where it is
    above bag of words; else "bag of words"."""
    bow, direct = s["bag_of_words"]["test"], s["finetune"]["pretrained"]["test_mean"]
    if "distill" not in s:
        return "finetuned" if direct > bow else "bag of words"
    student = s["distill"]["student"]["test_mean"]
    if student > bow and student >= direct:
        return "distilled"
    return "teacher" if s["distill"]["teacher"]["test"] > bow else "bag of words"


def deploy_verdict(s: dict) -> list[str]:
    """Which Rotten Tomatoes model a user should deploy, and why, in sentences: the distilled student when it beats
    the other small models and bag of words; plainly, every BERT row that bag of words is above."""
    d, model = s["distill"], f"BERT-{s['model']}"
    teacher, student = d["teacher"]["test"], d["student"]["test_mean"]
    bow = s["bag_of_words"]["test"]
    rows = {f"the teacher MiniLM-L6 ({teacher:.1f})": teacher,
            f"{model} distilled ({student:.1f})": student,
            f"{model} fine-tuned on the labels alone ({s['finetune']['pretrained']['test_mean']:.1f})":
                s["finetune"]["pretrained"]["test_mean"],
            f"{model} from random weights ({s['finetune']['scratch']['test_mean']:.1f})":
                s["finetune"]["scratch"]["test_mean"]}
    below = [name for name, score in rows.items() if score < bow]
    lines = [f"Bag of words ({bow:.1f}) is above {', '.join(below)}: "
             f"{'those models are' if len(below) > 1 else 'that model is'} not worth deploying for this task."] \
        if below else []
    speedup = d["texts_per_s"]["student"] / d["texts_per_s"]["teacher"]
    direct = s["finetune"]["pretrained"]["test_mean"]
    choice = deployed(s)
    if choice == "distilled":
        lines.append(f"Deploy the distilled {model}: {student:.1f} test accuracy, {100 * student / teacher:.0f}% of "
                     f"the teacher's {teacher:.1f} at {speedup:.0f}x its speed, {student - direct:+.1f} points over "
                     f"{model} fine-tuned on the labels alone and {student - bow:+.1f} over bag of words.")
        if teacher - student > 2:
            lines.append(f"Where {teacher - student:.1f} more points matter more than speed, serve the teacher "
                         f"({d['texts_per_s']['teacher']:,.0f} texts/s).")
    elif choice == "teacher":
        beaten = "bag of words" if student <= bow else f"{model} fine-tuned on the labels alone"
        lines.append(f"Deploy the teacher MiniLM-L6 ({teacher:.1f}, {d['texts_per_s']['teacher']:,.0f} texts/s on this "
                     f"CPU): the distilled {model} did not beat {beaten} here.")
    else:
        lines.append(f"Deploy bag of words ({bow:.1f}): no BERT here beats it on this task.")
    if "transfer_texts" in d["student"]:  # summaries before --transfer-texts have none
        blend = " and a bag of words in its teacher (--blend-bag-of-words)" if d["student"].get(
            "blend_bag_of_words") else ""
        lines.append(f"The distilled {model} learned from up to {d['student']['transfer_texts']:,} snippets of the "
                     f"corpus (--transfer-texts){blend}: where the corpus holds more, more kept paying in our runs, at "
                     f"the student's training time (docs/distillation.md).")
    return lines


def _tuned_verdict(s: dict) -> list[str]:
    """What the summary's figures say, in sentences: whether the difference stands out from the seeds' noise
    (two standard errors of the difference of the means), and what to change when pretraining did not help."""
    pre, scr = s["finetune"]["pretrained"], s["finetune"]["scratch"]
    n_pre, n_scr = len(pre["runs"]), len(scr["runs"])
    diff = pre["test_mean"] - scr["test_mean"]
    lines = []
    mlm = s["pretraining"]["mlm_accuracy"]
    if mlm < PLATEAU_MLM_ACCURACY:
        lines.append(f"Pretraining ended on the masked-LM's early plateau (val MLM accuracy {100 * mlm:.1f}%: the "
                     "model still guesses frequent words), so it has little to give yet; leaving it took 1-5M "
                     "tokens in our runs. Give it more time, e.g. --minutes 30.")
    if min(n_pre, n_scr) < 2:
        lines.append(f"Difference {diff:+.1f} points from one seed a side: no spread to judge it by "
                     "(--finetune-seeds 3 or more).")
        return lines
    two_se = _two_standard_errors(pre, scr)
    if diff > two_se:
        lines.append(f"Pretraining helped: {diff:+.1f} points, more than two standard errors of the difference "
                     f"({two_se:.1f}).")
        return lines
    if diff < -two_se:
        lines.append(f"Random weights did better, by {-diff:.1f} points (two standard errors: {two_se:.1f}).")
    else:
        lines.append(f"The difference ({diff:+.1f} points) is within two standard errors ({two_se:.1f}): the seeds "
                     "do not tell the two apart.")
    if mlm >= PLATEAU_MLM_ACCURACY:
        lines += _more_time_advice(s.get("pretrain_minutes", 0), s.get("cpu_bf16", False))
    return lines


def _two_standard_errors(pre: dict, scr: dict) -> float:
    return 2 * math.sqrt(pre["test_std"] ** 2 / len(pre["runs"]) + scr["test_std"] ** 2 / len(scr["runs"]))


def _untuned_verdict(u: dict, model: str) -> list[str]:
    """Sentences on the task no setting was chosen on: the difference weighed as the first task's is, then, plainly,
    the BERT rows bag of words is above there."""
    return [_untuned_difference(u), *_untuned_below_bag_of_words(u, model)]


def _untuned_difference(u: dict) -> str:
    """One sentence on the untuned task's difference, weighed as the first task's difference is."""
    pre, scr = u["finetune"]["pretrained"], u["finetune"]["scratch"]
    diff = pre["test_mean"] - scr["test_mean"]
    head = f"On {u['title']}, where no setting of ours was chosen, "
    if min(len(pre["runs"]), len(scr["runs"])) < 2:
        return head + f"the difference is {diff:+.1f} points from one seed a side."
    two_se = _two_standard_errors(pre, scr)
    if diff > two_se:
        return head + f"pretraining helped: {diff:+.1f} points (two standard errors: {two_se:.1f})."
    if diff < -two_se:
        return head + f"random weights did better, by {-diff:.1f} points (two standard errors: {two_se:.1f})."
    return head + f"the difference ({diff:+.1f} points) is within two standard errors ({two_se:.1f})."


def _untuned_below_bag_of_words(u: dict, model: str) -> list[str]:
    """A sentence naming the untuned task's BERT rows below its bag of words, if any."""
    bow = u.get("bag_of_words", {}).get("test")
    sides = (("the pretrained model", u["finetune"]["pretrained"]), ("random weights", u["finetune"]["scratch"]))
    below = [f"{name} ({side['test_mean']:.1f})" for name, side in sides if bow is not None and side["test_mean"] < bow]
    if not below:
        return []
    # bench/distill.py --task imdb, 3 seeds, reviews read whole: 87.5 +- 0.3 against bag of words' 87.3
    known = (" (distilled from a MiniLM-L6 fine-tuned on IMDB, BERT-tiny reached bag of words' level there in our "
             "runs: docs/distillation.md)") if model == "tiny" and u["title"] == "IMDB" else ""
    return [f"On {u['title']} bag of words ({bow:.1f}) is above BERT-{model} fine-tuned from "
            f"{' and from '.join(below)}: fine-tuned on the labels alone, BERT-{model} is not worth deploying "
            f"there{known}."]


def _more_time_advice(minutes: float, cpu_bf16: bool) -> list[str]:
    """Where pretraining pays, from bench/pays.py's runs of tiny on this demo's data, 5 seeds a side, each side's lr
    chosen on dev (docs/experiments/budget-curve.md). The budget buys about twice the steps where the CPU
    has bf16 instructions, so the figures are those of the CPU kind the demo ran on. Tiny's 10 minutes without
    bf16 gained nothing with 1,000 labels either (-0.6 and -1.6 in two runs), so fewer labels alone is no advice."""
    if cpu_bf16 and minutes < 30:
        return ["Pretraining pays with more time: on a CPU with bf16 instructions, as this one, BERT-tiny "
                "(--model tiny) gained +2.0 points over random weights with all labels at --minutes 10 and +3.1 to "
                "+3.8 at --minutes 30 in our runs (three pretrainings, every pretrained seed above every random one; "
                "from 30 minutes on the demo fine-tunes for 4 epochs). With the first 1,000 labels "
                "(--finetune-examples 1000): +4.9 and +6.1."]
    if not cpu_bf16 and minutes < 60:
        return ["Pretraining pays with more time: on a CPU without bf16 instructions, as this one, BERT-tiny "
                "(--model tiny) gained +1.5 points over random weights with all labels at --minutes 30 and +2.7 at "
                "--minutes 60 in our runs (every pretrained seed above every random one; +5.6 with the first 1,000 "
                "labels, --finetune-examples 1000)."]
    return []


def report(s: dict, out: Path) -> str:
    v = s["vocabulary"]
    vocab_lines = ", ".join(f"{k} {v[k]}" for k in v if isinstance(v[k], (int, float)))
    return f"""# bertforge demo report

Total time: {s['minutes']} minutes.

## Results

```
{table(s)}
```

A majority-class guess scores about 58% on Rotten Tomatoes. The bag-of-words row is a logistic regression on the
TF-IDF weights of each snippet's words and word pairs, trained on the same labels (`bertforge.baseline`): on
short sentiment snippets it does about as well as a small BERT fine-tuned from random weights, so a pretrained
model has to learn more than which words occur to beat it.

The untuned task is the IMDB reviews' own labels (`bertforge.demo.imdb`; half positive), its dev and test reviews
never pretrained on. The models train on a review's first 128 tokens and are scored reading it whole, in up to 8
windows of 128 tokens whose outputs are averaged (`--windows`), as bag of words reads every word. No setting of
ours was chosen on it: each side tries the same learning rates and keeps the one its own dev split prefers. The
word-vector rows measure how far the pretrained embeddings have collapsed toward one direction
(`bertforge.pretrain.isotropy`), a random initialisation's figure in brackets.

## Vocabulary

{vocab_lines}

## Pretraining curves

![pretraining](pretrain/training_curves.svg)

## Fine-tuning curves

From the pretrained model (first seed):

![from pretrained](finetune-pretrained/seed0/training_curves.svg)

From random initialisation (first seed):

![from scratch](finetune-scratch/seed0/training_curves.svg)

Files: `pretrain/` (the pretrained model, `metrics.jsonl`, `budget_plan.json`, checkpoints),
`finetune-*/seed*/` (fine-tuned models, `metrics.json`, `scores.json`, dev and test predictions), `summary.json`
(everything above as JSON, with every seed's dev and test accuracy).
"""
