"""What data is, for every entry point: the one package that decides (pure numpy, no Keras, no Spark).

``model.fit`` under ``%%dist_train``, ``--data X,y``, ``nbdist.train(model, x, y)``, ``%dist_evaluate`` and
``%dist_predict`` all take their in-memory data through ``inputs.make_fit_data``: ``x``, ``y`` and the sample
weights may each be an array (numpy, pandas, a nested list, a whole-file ``np.load(..., mmap_mode="r")``, a
``tf.RaggedTensor`` as its numpy components: ragged.py), a list of them or a dict of them (several inputs /
outputs), all with the same number of rows; a ``keras.utils.PyDataset`` goes through
``inputs.make_py_dataset_data``; a finite ``tf.data`` pipeline or a torch DataLoader over tensors is read once
into arrays (pipelines.py); a generator, or a pipeline that cannot be read soundly, is refused in one sentence
(``files.pipeline_message``). Spark DataFrames and RDDs stay on the executors (spark/data.py). The driver
splits the rows exactly as Keras would (``validation_split`` takes the last rows, before any shuffling;
``class_weight`` becomes per-row sample weights), deals them so that every global batch is split over the
workers (``sharding.deal_rows``), and sends each worker its rows as flat arrays plus a JSON layout that
rebuilds the nesting on the worker (``structures.flatten`` / ``unflatten``).

structures.py: nested arrays (flatten, unflatten, leaves, conversions, where an input's kind is decided:
``to_struct``); ragged.py: a RaggedTensor's rows as numpy (gathered, joined); files.py: memory-mapped ``.npy``
files and the memory budget; inputs.py: FitData / PyDatasetData, built once at the door; sharding.py:
which rows and batches each worker takes; pipelines.py: tf.data / torch DataLoader input read into arrays.
"""
