"""Paged-KV kernels (Triton) and their torch references, behind one dispatch layer.

Callers use the functions re-exported here; each picks Triton on CUDA and the torch reference on
CPU unless ``backend`` says otherwise (see dispatch.py). Layout: per layer K and V
``[num_blocks, block_size, num_kv_heads, head_dim]``, int32 block tables ``[num_seqs, max_blocks]``,
int64 slot mappings (slot = block * block_size + offset). Launch parameters (warps, stages, the
decode's split plan) are in tuning.py; aot.py compiles every kernel for GPU targets without a GPU.
"""
import sys

if __name__ == "kernels":  # pragma: no cover (this folder imported under another package's name)
    # This folder is the package kvbench.kernels. Imported as a top-level ``kernels`` (a checkout's root
    # on sys.path: ``python -m`` or pytest run there), it would shadow Hugging Face's ``kernels``, which
    # transformers imports (a requirement from 5.25 on): the name is handed to that package where it is
    # installed, the import system returning what sys.modules holds once this module has run.
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _theirs = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _theirs
        _spec.loader.exec_module(_theirs)

from kvbench.kernels.dispatch import (BACKENDS, attention_weights, copy_blocks, decode_attention,  # noqa: E402
                                      prefill_attention, use_triton, write_kv)

__all__ = ["BACKENDS", "attention_weights", "copy_blocks", "decode_attention", "prefill_attention",
           "use_triton", "write_kv"]
