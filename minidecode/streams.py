"""What a caller of the API iterates: one request's `Stream` of text pieces, a prompt list's
`BatchStream` of (index, piece) with its `BatchProgress`. Each reads only its own events, which the
engine loop's thread puts in its queue (loop.py); closing one early aborts its requests."""

from __future__ import annotations

import queue
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Self

from .errors import UserError
from .loop import EngineLoop
from .sequence import Event, GenerationResult, Sequence


class Stream:
    """Iterate for text pieces as they are decoded (never a broken UTF-8 character); `.result` is
    the GenerationResult once it has ended. Closing it early (`close()`, leaving its `with` block,
    or dropping it) aborts the request at the next step."""

    def __init__(self, loop: EngineLoop, seq: Sequence, events: queue.SimpleQueue):
        self._loop, self._seq, self._events = loop, seq, events
        self.result: GenerationResult | None = None
        self._finalizer = weakref.finalize(self, loop.abort, [seq])
        self._finalizer.atexit = False

    def events(self) -> Iterator[Event]:
        """Every event (a token with its text piece, possibly "", then the end); a request that
        fails raises its error here."""
        try:
            while self.result is None:
                event = self._events.get()
                if event.error is not None:
                    self.result = event.result
                    raise (RuntimeError if event.fatal else UserError)(event.error)
                if event.result is not None:
                    self.result = event.result
                yield event
        finally:
            self.close()

    def __iter__(self) -> Iterator[str]:
        for event in self.events():
            if event.piece:
                yield event.piece

    def close(self) -> None:
        """Stop generating (if still running): its row and region are freed at the next step."""
        if self.result is None:
            self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class BatchProgress:
    """Counts for a progress display; tokens are new tokens handed out."""

    total: int = 0
    done: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    new_tokens: int = 0
    # the ended requests' decode steps and speculation's drafts (proposed, kept), summed
    decode_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(time.perf_counter() - self.started, 1e-9)


class BatchStream:
    """Iterate for (prompt index, text piece) as the prompts decode (interleaved); `.results` fills
    in as requests end, in order (a refused one has finish_reason "error" and `.error`). Closing it
    early aborts the requests still running."""

    def __init__(
        self,
        loop: EngineLoop,
        seqs: list[Sequence],
        results: list[GenerationResult | None],
        events: queue.SimpleQueue,
        on_result: Callable[[int, GenerationResult], None] | None,
    ):
        self._loop, self._seqs, self._events, self._on_result = loop, seqs, events, on_result
        self.results = results
        self.progress = BatchProgress(total=len(results), failed=sum(r is not None for r in results))
        self.progress.waiting = len(seqs)
        self._started: set[int] = set()
        self._finalizer = weakref.finalize(self, loop.abort, seqs)
        self._finalizer.atexit = False

    def events(self) -> Iterator[Event]:
        """Every event of the prompts (tokens with their text pieces, possibly "", and ends), as
        they happen; `.results` and `.progress` follow them."""
        try:
            if self._on_result is not None:  # the requests refused as read come first
                for i, result in enumerate(self.results):
                    if result is not None:
                        self._on_result(i, result)
            pending = len(self._seqs)
            while pending:
                event = self._events.get()
                if event.done:
                    pending -= 1
                    self._ended(event)
                elif event.token is not None:
                    p = self.progress
                    if event.index not in self._started:
                        self._started.add(event.index)
                        p.running, p.waiting = p.running + 1, p.waiting - 1
                    p.new_tokens += 1
                yield event
        finally:
            self.close()

    def __iter__(self) -> Iterator[tuple[int, str]]:
        for event in self.events():
            if event.piece:
                yield event.index, event.piece

    def _ended(self, event: Event) -> None:
        p, i = self.progress, event.index
        self.results[i] = event.result
        if event.result is not None:
            stats = event.result.stats
            p.decode_steps += stats.decode_steps
            p.proposed_tokens += stats.proposed_tokens
            p.accepted_tokens += stats.accepted_tokens
        if i in self._started:
            p.running -= 1
        else:
            p.waiting -= 1
        if event.error is not None:
            if event.fatal:
                raise RuntimeError(event.error)
            p.failed += 1
        else:
            p.done += 1
        if self._on_result is not None:
            self._on_result(i, event.result)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
