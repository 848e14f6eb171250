"""The machine a worker runs on: processes, devices and the Keras backend (pure logic, no Keras imported).

processes.py: process groups, cores, exits, logs and the out-of-memory killer.
placement.py: devices, thread budgets and worker counts (GPUs, NCCL, JAX memory).
engines.py: which engine sums a run's gradients or averaging rounds: one ordered choice (``select``).
keras_backend.py: the notebook's Keras backend and what a worker must be told to run it.
"""
