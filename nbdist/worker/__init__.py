"""The worker program every backend starts: ``python -m nbdist.worker``.

__main__.py: the entry: imports TensorFlow quietly (on its backend only), then runs main.py.
main.py: connect, authenticate, receive the job, run it, report.
runtime.py: what every job needs whatever its kind: its message decoded, its thread budget.
training.py: the training job: the notebook's model with its state, rendezvous, fit.
allreduce_fit.py: a training run under ``--strategy allreduce``.
elastic.py: an elastic run: commits in memory, a broken collective reported, the next generation trained.
async_fit.py: ``--strategy async``: blocks of local steps against the driver's shared model.
async_batches.py: where an async worker's batches come from (batch indices dealt by the driver).
inference.py: evaluation and prediction on the worker's shard.
device.py: which device this worker trains on, read from the framework that trains.
callbacks.py: Keras callbacks inside a worker: averaging rounds and the event stream.
callback_list.py: nbdist's batch-end hooks run in order, without Keras reading every step's logs.
fit_sync.py: per-epoch agreement: exact merged metrics, and the driver's callback decisions.
blocks.py: several steps per call into the train function, each call ending where the strategy needs it.
global_mask.py: a masked loss normalised by the global batch's valid entries.
phases.py: the phase report: computing or synchronising, and how long in each.
datasets.py: one repeated tf.data pipeline per ``fit`` over the worker's arrays.
streams.py: a Spark share streamed from its shard file in bounded memory.
pydatasets.py: this worker's share of a PyDataset's batches.
readahead.py: what the read-ahead threads (Spark streams, PyDataset shares) share.
tfdata.py: what every tf.data pipeline here is set up with.
validation.py: the validation pass's iterator, kept across epochs.
fork_server.py: the fork server local workers are forked from.
warm_socket.py: a warm worker on a Spark executor, its side: listen on a private socket, take one job.
"""
