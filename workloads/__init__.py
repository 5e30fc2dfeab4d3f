"""Workload generators for ``kvbench trace gen`` (installed as ``kvbench.workloads``).

Each module defines one workload: a parameter dataclass (whose fields become the command's flags)
and a ``build`` function; ``generate`` runs one with a seeded numpy Generator, so a trace is fully
determined by its flags. Shared pieces: ``sampling`` (lengths, arrivals), ``common`` (session assembly).
"""
from kvbench.workloads import agent, best_of_n, chat, rag, random_lengths
from kvbench.workloads.common import Common, Workload, generate

WORKLOADS: dict[str, Workload] = {w.name: w for w in (chat.WORKLOAD, rag.WORKLOAD, agent.WORKLOAD,
                                                       best_of_n.WORKLOAD, random_lengths.WORKLOAD)}

__all__ = ["WORKLOADS", "Workload", "Common", "generate"]
