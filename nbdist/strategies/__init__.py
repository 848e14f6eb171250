"""How workers sum and average: the engines the selector (machine/engines.py) chooses, and the Keras hooks.

allreduce_hook.py: TensorFlow's optimizer hook, pad steps and the epoch's statistics average.
backend_grads.py: the same hook for Keras' torch and JAX backends.
gradient_sum.py: the host bucket of a step's gradients and its exchange.
shared.py: sums through shared memory between workers of one machine (small and chunked).
shm_files.py: the files behind shared-memory segments.
collective.py: the Gloo collective (torch.distributed) behind a small interface.
host_collective.py: workers of one machine meeting and summing without torch.
device_sum.py: torch's buckets on the tensors' device (NCCL, or Gloo on CPU tensors), for torch and TensorFlow.
torch_overlap.py: those buckets started during torch's backward pass.
jax_device_sum.py: JAX's psum inside the jitted step.
averaging.py: the averaging strategy's rounds.
sparse_grads.py: sparse gradients' slices under allreduce.
fused_updates.py: Keras' Adam and SGD as TensorFlow's fused kernels.
async_sgd.py: the async strategy's rule.
lr_scaling.py: the learning-rate rule for N workers.
"""
