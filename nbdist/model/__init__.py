"""The model: what travels to the workers and comes back, and what is read from it (no Spark, no sockets).

spec.py: ``ModelSpec`` (the model as it crosses the wire: config, weights, optimizer state, custom
objects) and the strategy a model implies; graph.py: what the model's traced graph says (sparse
gradients, layers that need care); tensors.py: backend tensors as numpy and back (ragged rows as
tf.RaggedTensor); metrics.py: metric state merged exactly over workers; labels.py: labels checked with
Keras' own loss; seeding.py: a run's seed from the notebook's generators; ensemble.py: the averaging
``Ensemble`` model of a search's best trials.
"""
