"""Distillation: a small student trained on a fine-tuned teacher's outputs over the task's examples and unlabelled
text, through fine-tuning's run machinery (`bertforge.finetune.run.train_task`): config.py (`DistillConfig`), run.py
(`distill`), teacher.py (the teacher's outputs, cached beside a manifest), transfer.py (the transfer set cut from a
corpus), objective.py (the loss: T^2 KL at a temperature plus the labels' own loss)."""
