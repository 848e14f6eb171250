"""What data is, for every entry point: the one package that decides (pure numpy, no Keras, no Spark).

Every entry point's in-memory data goes through ``inputs.make_fit_data`` (or ``make_py_dataset_data``), is
split exactly as Keras would, dealt so that every global batch is split over the workers, and sent to each
worker as flat arrays plus a JSON layout that rebuilds the nesting there. Spark data stays on the executors.

inputs.py: ``FitData`` / ``PyDatasetData``, built once at the door.
structures.py: nested arrays (flatten, unflatten, leaves, conversions; an input's kind: ``to_struct``).
ragged.py: a RaggedTensor's rows as numpy (gathered, joined).
files.py: memory-mapped ``.npy`` files and the memory budget.
sharding.py: which rows and batches each worker takes, and a PyDataset's epoch hooks alike on every worker.
pipelines.py: tf.data / torch DataLoader input read once into arrays.
torch_loaders.py: a DataLoader over a lazy map-style dataset, split by index over the workers.
"""
