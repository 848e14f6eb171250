"""The driver: a run as the notebook sees it, from the checked request to the merged History.

run.py: ``Run``, a run's life cycle: start workers, send each its job, follow them, finish.
training.py: a training run: the model and its shards out, merged metrics and weights back.
inference.py: the jobs under ``evaluate()`` and ``predict()``.
async_server.py: ``--strategy async``'s shared model, served from the run's event loop.
coordinator.py: the driver's side of the wire: accepts workers, authenticates them, relays their messages.
resolve.py: which backend a run uses and how many workers (``resolve_world``).
fit_call.py: a cell's ``model.fit(...)`` intercepted: its arguments, its data dealt, its callbacks.
callbacks.py: the notebook's Keras callbacks, run here with the workers' merged logs.
checkpoint.py: checkpoints on disk, one npz file replaced atomically after every epoch.
keeper.py: a run's checkpoints as the driver keeps them: where training starts, where a restart resumes.
membership.py: who trains in an elastic run, by generation: who left, the survivors' commits, the next world.
health.py: a run's watch over its workers: which one ended, hung, never connected or stayed silent.
failures.py: the sentence for a worker's end, and which of several ended workers is the likely cause.
interrupts.py: interrupts held while workers are being stopped, so a second Ctrl-C cannot cut a stop in half.
state.py: ``RunState``, what a run looks like, built from worker events (pure).
search_state.py: what a hyperparameter search looks like: pure state of its trials.
"""
