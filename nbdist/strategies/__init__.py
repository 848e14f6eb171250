"""How workers sum and average: the engines the selector (machine/engines.py) chooses, and the Keras hooks.

allreduce_hook.py: TensorFlow's optimizer hook and pad steps; backend_grads.py: the same for torch and JAX;
gradient_sum.py: the host bucket and its exchange; shared.py / shm_files.py: sums through shared memory
(small and chunked); collective.py: the Gloo collective; host_collective.py: shared memory without torch;
device_sum.py: torch's buckets on the tensors' device (NCCL, or Gloo on CPU tensors); torch_overlap.py: those
buckets during the backward pass; tf_device_sum.py: TensorFlow's tensors into them by DLPack;
jax_device_sum.py: JAX's psum inside the step; averaging.py: averaging rounds; sparse_grads.py: sparse
gradients' slices; fused_updates.py: fused Adam/SGD kernels; async_sgd.py: the async strategy;
lr_scaling.py: the learning-rate rule.
"""
