"""Prompts' prefills kept in host memory beyond the slots (`[server] prompt_cache_bytes`).

A slot keeps only its last prompt's prefill (SlotPool.give_back), so a stream of requests cycling
through more templates or documents than there are slots prefills each one again. Before a slot's
kept cells are dropped for a request with another prompt, the engine copies them here:
the target's sequence 0 (the KV of the prompt's positions, `backend.Context.seq_state`) and,
where a head drafted there, the head's positions and the features it had not absorbed. A later
request whose prompt shares a longer prefix with an entry than with any slot gets the entry's
cells written back into its slot's sequence 0 (`load_seq_state`), and prefills only the rest.

Exact: with batch-invariant forwards a prompt position's KV depends on the tokens before it only,
not on how the prompt was split into forwards, so restored cells are the bits a new prefill would
write (Engine.batch_invariant; elsewhere entries are reusable up to whole n_batch chunks, as a
slot's own). Bounded: entries are evicted least recently used first beyond `max_bytes`, and one
larger than that is not kept. Partitioned like the suffix cache: by default an entry serves only
the caller whose request left it (its prompt's TTFT would otherwise tell another caller whether
that prompt was seen; docs/appliance.md, threat model).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from edgespec.drafters.eagle3 import HeadCache


@dataclass(frozen=True)
class StoredPrompt:
    """One slot's kept cells, copied out: the target's KV of context positions 0..len(prefill)-1
    and, optionally, the head's positions with the features it had not absorbed (`head`)."""

    partition: str
    prefill: tuple[int, ...]
    target: bytes
    head: HeadCache | None = None
    head_cells: bytes = b""

    @property
    def nbytes(self) -> int:
        g = self.head.g.nbytes if self.head is not None and self.head.g is not None else 0
        tokens = 8 * (len(self.prefill) + (len(self.head.tokens) if self.head is not None else 0))
        return len(self.target) + len(self.head_cells) + g + tokens

    # what SlotPool.kept_prefill asks of a donor (a slot or an entry)
    def head_to_lend(self, kind: str) -> HeadCache | None:  # a slot's signature
        return self.head


class PromptStore:
    """Least-recently-used entries bounded in bytes, looked up by partition."""

    def __init__(self, max_bytes: int, pooled: bool = False):
        self.max_bytes = max_bytes
        self.pooled = pooled
        # by id(entry): an entry is held here for as long as its key is in use
        self._entries: collections.OrderedDict[int, StoredPrompt] = collections.OrderedDict()
        self.bytes = 0
        self.stats = {"stored": 0, "evicted": 0, "hits": 0, "restored_tokens": 0}

    def partition_of(self, caller: str) -> str:
        return "" if self.pooled else caller

    def __len__(self) -> int:
        return len(self._entries)

    def candidates(self, caller: str) -> Iterator[StoredPrompt]:
        part = self.partition_of(caller)
        return (e for e in self._entries.values() if e.partition == part)

    def holds(self, partition: str, prefill: tuple[int, ...], head: HeadCache | None) -> bool:
        """Whether an entry of `partition` already covers this prefill and head (copying them out
        again would add nothing: SlotPool.store skips the copy)."""
        probe = StoredPrompt(partition, prefill, b"", head)
        return any(e.partition == partition and _covers(e, probe) for e in self._entries.values())

    def put(self, entry: StoredPrompt) -> bool:
        """Keep `entry` (most recently used); an entry of the same partition it covers (the same
        prefill or a prefix of it, and no head that the new one lacks) goes. Returns whether kept."""
        if not entry.prefill or entry.nbytes > self.max_bytes:
            return False
        for key, old in list(self._entries.items()):
            if old.partition == entry.partition and _covers(entry, old):
                self._drop(key)
        self._entries[id(entry)] = entry
        self.bytes += entry.nbytes
        self.stats["stored"] += 1
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats["evicted"] += 1
        return True

    def used(self, entry: StoredPrompt, tokens: int) -> None:
        """`entry` served a request `tokens` positions: it becomes the most recently used."""
        if id(entry) in self._entries:
            self._entries.move_to_end(id(entry))
        self.stats["hits"] += 1
        self.stats["restored_tokens"] += tokens

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def figures(self) -> dict[str, float]:
        return {"entries": len(self._entries), "bytes": self.bytes, **self.stats}

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes


def _covers(new: StoredPrompt, old: StoredPrompt) -> bool:
    if not _prefix(old.prefill, new.prefill):
        return False
    if old.head is None:
        return True
    return new.head is not None and _prefix(old.head.tokens[:old.head.n_features + 1], new.head.tokens) \
        and new.head.n_features >= old.head.n_features


def _prefix(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) <= len(b) and tuple(b[:len(a)]) == tuple(a)
