"""Layer 5, executors: ``sim`` (roofline cost model) and ``model`` (a real transformer on paged KV).
Chosen by name (``--executor``) from EXECUTORS; both implement kvbench.executors.base.Executor."""
from __future__ import annotations

from kvbench.executors.base import Executor


def _make_sim(cfg, model):
    from kvbench.executors.presets import get_gpu
    from kvbench.executors.sim import make_sim

    return make_sim(model, get_gpu(cfg.gpu), cfg.calibration, cfg.kv_dtype, tp=cfg.tp,
                    max_batched_tokens=cfg.max_batched_tokens, max_num_seqs=cfg.max_num_seqs, dtype=cfg.dtype,
                    eager=cfg.eager, front_end=cfg.front_end)


def _make_model(cfg, model):
    from kvbench.executors.model import make_model_executor

    return make_model_executor(cfg, model)


EXECUTORS = {"model": _make_model, "sim": _make_sim}


def make_executor(cfg, model) -> Executor:
    """The executor named by ``cfg.executor`` for a ModelSpec."""
    return EXECUTORS[cfg.executor](cfg, model)


__all__ = ["Executor", "EXECUTORS", "make_executor"]
