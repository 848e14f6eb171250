"""``nbdist.tune``: an Optuna search whose trials are nbdist runs, several at once, pruned on merged metrics.

Each trial builds a model with Optuna's ``trial`` (a function of yours, or the ``%%dist_tune``
cell) and trains it as an nbdist run on ``workers_per_trial`` workers of the backend; up to
``parallel`` trials run at once. Everything happens on the calling (notebook's main) thread,
which pumps every running trial's events in turn: a trial's merged epoch is reported to Optuna
there (``trial.report``), and when its pruner says so that trial's workers are stopped at once,
freeing its slot for the next trial. The study lives in Optuna's storage (an SQLite file by
default), so a search that was interrupted resumes where it was: finished trials count towards
``trials`` and are not run again. An interrupt stops every trial's workers and tells the storage
those trials failed (marked ``nbdist_interrupted``), leaving no trial RUNNING.

The trial's cell runs up to its ``model.fit(...)``: that call's arguments are the trial's run, and
what follows it in the cell does not run (the objective is the merged metric named ``objective``,
its value at the last epoch). A cell without ``model.fit`` returns (or assigns) a compiled model,
trained on ``x``/``y`` with the options.

study.py: Optuna's side (the study, its storage, pruners, directions); scheduler.py: ``Search``, which
runs the trials as nbdist jobs several at once on the notebook's thread; entry.py: ``tune`` and
``make_search``, the checked door to it.
"""
