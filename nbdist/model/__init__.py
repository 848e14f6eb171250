"""The model: what travels to the workers and comes back, and what is read from it (no Spark, no sockets).

spec.py: ``ModelSpec`` (the pickled model, its weights and optimizer state as arrays), ``apply_state``, Keras' own
  methods past a class's overrides (``keras_own``).
graph.py: the model pickled by its attributes (``dump_graph``/``load_graph``), and what cannot travel.
tensors.py: a framework's tensors as the arrays they travel as, and back.
metrics.py: exact evaluation from per-shard sufficient statistics (pure numpy).
labels.py: labels checked against the model's loss by Keras itself, before any worker starts.
seeding.py: a run's seed from ``--seed`` or the notebook's generators; each worker's seeding.
ensemble.py: an ensemble of trained models (the mean of their predictions): a search's best trials.
"""
