"""Worker processes: the torch side. One process per GPU (per pipeline rank);
rank 0 runs the engine loop (``rtvideo.engine.loop``) over a ``ModelRunner``.

Importing this package makes ``torch.cuda.is_available()`` ask NVML rather than
the CUDA runtime (``PYTORCH_NVML_BASED_CUDA_CHECK``, unless already set), so a
process that has only imported the worker's modules stays safe to fork: the
fork server that preloads them (``rtvideo.engine.client.engine_client``) forks every worker, and a
CUDA runtime call there (libraries ask ``is_available()`` at import) would
leave each fork unable to use the GPU ("Cannot re-initialize CUDA in forked
subprocess")."""

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
