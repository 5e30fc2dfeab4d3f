"""The declared contracts hold at run time too: every KV layout is a KVManager, both block pools (the
Python reference and the compiled one) are a BlockPoolAPI, and the sim executor has every member of
the Executor protocol. mypy checks the same statically (its own CI step); these fail in the suite when
a class drops a declared member."""
from __future__ import annotations

import pytest

from kvbench.executors.base import Executor
from kvbench.executors.presets import GPUS, MODELS
from kvbench.executors.sim import make_sim
from kvbench.memory import LAYOUTS, BlockPool, BlockPoolAPI, KVManager, PagedKV, make_kv
from kvbench.memory.array_pool import ArrayBlockPool


def members(proto: type) -> set[str]:
    """The names a Protocol declares: its annotated attributes and its methods."""
    names = set(proto.__annotations__)
    names |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return names


def missing(obj: object, proto: type) -> set[str]:
    return {n for n in members(proto) if not hasattr(obj, n)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_is_a_kv_manager(layout):
    kv = make_kv(layout, 64, 16)
    assert missing(kv, KVManager) == set()
    assert isinstance(kv, KVManager)


@pytest.mark.parametrize("pool", [BlockPool, ArrayBlockPool])
def test_both_block_pools_are_the_declared_pool(pool):
    p = pool(64, 16)
    assert missing(p, BlockPoolAPI) == set()
    assert isinstance(p, BlockPoolAPI)


def test_paged_kv_takes_the_compiled_pool_where_it_serves():
    assert isinstance(PagedKV(64, 16).pool, ArrayBlockPool)  # hash mode, lru: vLLM's configuration
    assert isinstance(PagedKV(64, 16, cache_policy="fifo").pool, BlockPool)


def test_the_sim_is_an_executor():
    ex = make_sim(MODELS["llama-3-8b"], GPUS["h200"])
    assert missing(ex, Executor) == set()
    from kvbench.executors import presets
    # a preset's server front end (the API process), fitted to published low-load TTFTs
    assert ex.front_end == (presets.REQUEST_S, presets.REQUEST_TOKEN_S, presets.REQUEST_LATENCY_S)
