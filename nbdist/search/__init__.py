"""``nbdist.tune``: an Optuna search whose trials are nbdist runs, several at once, pruned on merged metrics.

Each trial builds a model with Optuna's ``trial`` (a function of yours, or the ``%%dist_tune`` cell, run up
to its ``model.fit(...)``, whose arguments are the trial's run) and trains it on ``workers_per_trial``
workers; up to ``parallel`` trials run at once, all pumped on the notebook's thread.

entry.py: ``tune`` and ``make_search``, the checked door to a search.
scheduler.py: ``Search``, which runs the trials as nbdist jobs several at once and prunes them.
study.py: Optuna's side: the study, its storage, pruners, directions.
"""
