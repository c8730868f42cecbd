"""The parts of the ``lora_meta`` learner (:mod:`clients.lora_meta`, LoRA-ML / retraining / Reptile),
one job each; the learner composes them:

* :mod:`~clients.peft_meta.params` — ``client.params``, the allowed names, their validation;
* :mod:`~clients.peft_meta.environment` — binary tasks from a data set, the nodes' share of them,
  fresh LoRA networks and scoring;
* :mod:`~clients.peft_meta.methods` — the retraining methods as plug-ins (a node's round without DP
  and under DP-SGD);
* :mod:`~clients.peft_meta.dp` — the DP-SGD loss tally and a task's own DP context (reptile);
* :mod:`~clients.peft_meta.adaptation` — the server's few-shot LoRA evaluation on the new task;
* :mod:`~clients.peft_meta.report` — the run's final metrics and figure.

No registration here: the learner registers in :mod:`clients.lora_meta` (``fedsim/plugins.py``).
"""
