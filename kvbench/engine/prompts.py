"""What the live client sends: a request's prompt as token ids that keep the sim's one invariant
(spec §2). The sim's engine caches a request's prompt and, where ``output`` names it, the answer
stream it emits; a later prompt hits them where its tokens continue that sequence. Against a server
the answer is the server's, so a later prompt that continues an earlier request's prompt and answer
is sent as that request's *sent* prompt and *received* answer up to where it continues them, then as
the trace's own tokens. Content that only shares a name with an answer (an agent's task or tool
result quoted after it) is never replaced, so given the same cache a live request hits exactly what
the sim's request hits.

The rule is kept by a radix tree over the sim's token sequences (``Continuations``): each edge holds
its sim tokens and the tokens that were sent or received for them. Two sim sequences that agree on
their first k tokens are sent agreeing on exactly k (by induction over the requests: a prompt takes
the tree's tokens for the longest prefix the tree holds, its own after that). An answer not received
yet (or received shorter than the later prompt continues it) is a pending edge: a prompt that runs
into it is sent with the trace's tokens from there and counted as a fallback, naming both requests.

With ``n`` > 1 samples the answer a later turn continues is sample 0's, as in the sim
(``TokenStreams.output_tokens``): the server's choice 0.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvbench.errors import InputError
from kvbench.trace.format import Request
from kvbench.trace.ideal import IdealCounter, IdealHits
from kvbench.trace.tokens import TokenStreams, block_keys

_EMPTY = np.zeros(0, dtype=np.int64)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(slots=True, eq=False)
class _Edge:
    """A run of sim tokens; ``sent`` the tokens sent or received for them (same length), or None while
    the answer they belong to (request ``owner``'s) has not come back."""

    sim: np.ndarray
    sent: np.ndarray | None
    owner: str | None = None  # the request whose answer this edge is (pending or received)
    children: dict[int, "_Edge"] = field(default_factory=dict)  # first sim token -> edge


@dataclass(frozen=True, slots=True)
class Match:
    """A prompt's longest prefix the tree maps: ``sent`` its tokens (``length`` of them); where the
    match ran into an answer not received, ``waiting_for`` names that answer's request."""

    sent: np.ndarray
    length: int
    through_answer: bool  # the prefix continues some earlier request's received answer
    waiting_for: str | None


class Continuations:
    """Sim token sequences mapped onto the tokens the client sent and received for them."""

    def __init__(self) -> None:
        self.root = _Edge(_EMPTY, _EMPTY)

    def match(self, sim: np.ndarray) -> Match:
        """The longest prefix of ``sim`` the tree holds with known tokens."""
        node, pos, answer = self.root, 0, False
        parts: list[np.ndarray] = []
        while pos < len(sim):
            child = node.children.get(int(sim[pos]))
            if child is None:
                break
            if child.sent is None:
                return Match(_concat(parts), pos, answer, child.owner)
            k = common_prefix(child.sim, sim[pos:])
            parts.append(child.sent[:k])
            answer |= child.owner is not None
            pos += k
            if k < len(child.sim):
                break
            node = child
        return Match(_concat(parts), pos, answer, None)

    def insert(self, sim: np.ndarray, sent: np.ndarray, owner: str | None) -> None:
        """Add a sequence: its first ``len(sent)`` tokens were sent as ``sent``; the rest (an answer,
        ``owner``'s) is pending. Edges already there keep their tokens (the first writer's)."""
        node, pos = self.root, 0
        while pos < len(sim):
            child = node.children.get(int(sim[pos]))
            if child is None:
                self._attach(node, sim, sent, pos, owner)
                return
            k = common_prefix(child.sim, sim[pos:])
            if k < len(child.sim):
                child = self._split(node, child, k)
            node, pos = child, pos + k

    def receive(self, sim: np.ndarray, answer_from: int, answer: np.ndarray, owner: str) -> None:
        """``owner``'s answer came back: its pending edges along ``sim`` (whose answer starts at
        ``answer_from``) take the received tokens, as far as they go."""
        node, pos = self.root, 0
        while pos < len(sim):
            child = node.children.get(int(sim[pos]))
            if child is None or common_prefix(child.sim, sim[pos:]) < len(child.sim):
                return
            if child.sent is None and child.owner == owner:
                got = answer[pos - answer_from:]
                if len(got) == 0:
                    return
                if len(got) < len(child.sim):
                    child = self._split(node, child, len(got))
                child.sent = got[:len(child.sim)].astype(np.int64)
            node, pos = child, pos + len(child.sim)

    @staticmethod
    def _attach(node: _Edge, sim: np.ndarray, sent: np.ndarray, pos: int, owner: str | None) -> None:
        known = len(sent)
        if pos < known:
            edge = _Edge(sim[pos:known].astype(np.int64), sent[pos:known].astype(np.int64))
            node.children[int(sim[pos])] = edge
            node, pos = edge, known
        if pos < len(sim):
            node.children[int(sim[pos])] = _Edge(sim[pos:].astype(np.int64), None, owner)

    @staticmethod
    def _split(parent: _Edge, child: _Edge, k: int) -> _Edge:
        """Cut ``child`` after its first k tokens; -> the upper part (the lower keeps the children)."""
        upper = _Edge(child.sim[:k], None if child.sent is None else child.sent[:k], child.owner)
        child.sim = child.sim[k:]
        child.sent = None if child.sent is None else child.sent[k:]
        upper.children[int(child.sim[0])] = child
        parent.children[int(upper.sim[0])] = upper
        return upper


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else _EMPTY


@dataclass(frozen=True, slots=True)
class Fallback:
    """A prompt that continued an answer the client could not re-send (not back yet, an error, or
    fewer tokens than the prompt continues): sent with the trace's tokens from there on."""

    request: str
    answer_of: str


class PromptBuilder:
    """A request's prompt as token ids (the module's rule): ``build`` when it is sent, ``answer`` when
    it comes back. ``remap``: every id of the trace's own becomes id % vocab_size (deterministic, so
    equal ids stay equal; two ids may collide, which can only add hits where the trace has none)."""

    def __init__(self, requests: list[Request], vocab_size: int, remap: bool, trace_path: str,
                 streams: TokenStreams | None = None):
        self.streams = streams or TokenStreams()
        self.vocab_size = vocab_size
        self.remap = remap
        self.trace_path = trace_path
        self.tree = Continuations()
        self._sim: dict[str, tuple[np.ndarray, int]] = {}  # id -> (sim sequence, its prompt length)
        self.sent: dict[str, np.ndarray] = {}  # id -> the prompt sent
        self.received: dict[str, np.ndarray] = {}  # id -> the answer that came back (choice 0)
        self.resent = 0  # prompts that continued a received answer
        self.fallbacks: list[Fallback] = []

    def check_vocab(self, requests: list[Request]) -> None:
        """Refuse, before anything is sent, an id the served model does not have (it would crash a
        vLLM CPU worker): InputError naming the trace line and the segment."""
        if self.remap:
            return
        for r in requests:
            for j, seg in enumerate(r.prompt):
                ids = self.streams.segment(seg, r.id, j)
                if len(ids) and int(ids.max()) >= self.vocab_size:
                    how = "" if seg.kind == "tokens" else " (kvbench draws stream ids below 32,000)"
                    raise InputError(f"token id {int(ids.max())} is outside the served model's vocabulary of "
                                     f"{self.vocab_size:,}{how}: use --remap-vocab to map ids onto it",
                                     file=self.trace_path, line=r.line, field=f"prompt[{j}].{seg.kind}")

    def build(self, r: Request) -> np.ndarray:
        """The prompt to send for ``r`` (int64 ids); ``r``'s sequence joins the tree, its answer
        pending until ``answer``."""
        prompt = self.streams.expand(r).astype(np.int64)
        m = self.tree.match(prompt)
        own = prompt[m.length:] % self.vocab_size if self.remap else prompt[m.length:]
        sent = np.concatenate([m.sent, own])
        self.resent += m.through_answer
        if m.waiting_for is not None:
            self.fallbacks.append(Fallback(r.id, m.waiting_for))
        sim = prompt
        if r.output is not None:  # sample 0 emits the named stream in the sim
            sim = np.concatenate([prompt, self.streams.output_tokens(r, r.output_len).astype(np.int64)])
        self.tree.insert(sim, sent, r.id if r.output is not None else None)
        self._sim[r.id] = (sim, len(prompt))
        self.sent[r.id] = sent
        return sent

    def answer(self, r: Request, tokens: list[int] | np.ndarray | None, refused: bool = False) -> None:
        """``r`` came back with ``tokens`` (its choice 0; None or empty after an error). A request the
        server ``refused`` (too long) hits nothing: a fallback of its prompt lost no hit."""
        if refused:
            self.fallbacks = [f for f in self.fallbacks if f.request != r.id]
        got = np.asarray(tokens if tokens is not None else (), dtype=np.int64)
        self.received[r.id] = got
        sim, plen = self._sim.pop(r.id, (None, 0))
        if sim is not None and r.output is not None and len(got):
            self.tree.receive(sim, plen, got, r.id)

    def fallback_note(self, most: int = 5) -> str | None:
        """One line naming the prompts that could not continue an answer as received, or None."""
        if not self.fallbacks:
            return None
        named = ", ".join(f"{f.request} (answer of {f.answer_of})" for f in self.fallbacks[:most])
        more = f" and {len(self.fallbacks) - most} more" if len(self.fallbacks) > most else ""
        return (f"{len(self.fallbacks)} prompt(s) continued an answer that had not come back whole when they were "
                f"sent: {named}{more}; they went with the trace's tokens from there, so the server could not hit "
                "what it cached for that answer and hit rates are lower than the sim's")

    def ideal_hits(self, served: list[Request], block_size: int,
                   on_request: Callable[[Request, int], None] | None = None) -> IdealHits:
        """The ideal hit rate (spec §4) of what was sent: ``served`` in trace order, each looking up its
        sent prompt's whole blocks and caching its sent prompt and, where ``output`` names the answer,
        the first output - 1 tokens received."""
        counter = IdealCounter(block_size)
        for r in served:
            seq = self.sent[r.id]
            got = self.received.get(r.id, _EMPTY)
            if r.output is not None and len(got) > 1:
                seq = np.concatenate([seq, got[:len(got) - 1]])
            h = counter.add(block_keys(seq.astype(np.int32), block_size, as_array=True), len(self.sent[r.id]))
            if on_request is not None:
                on_request(r, h)
        return counter.result()


__all__ = ["Continuations", "Fallback", "Match", "PromptBuilder", "common_prefix"]
