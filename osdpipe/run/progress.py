"""Progress on long work: one live line on the launcher's terminal, fed by events from rank 0.

Ranks never draw: rank 0 *emits* events (a stage begins, n of m items done)
through :func:`emit` and :func:`track`, and whoever draws receives them. In a
local world that is the launcher, which gets them through a queue and also
draws its own phases (starting a world, generating the source); under
torchrun rank 0 draws them itself. So there is one display per run, never two
processes writing over each other's line.

The line is drawn with tqdm (rate, elapsed time and terminal width are solved
there; rich would bring a rendering stack osdpipe does not otherwise need),
only when stderr is a terminal and ``CI`` is unset.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")

#: An event: ("phase", text[, unit]) starts a new line of work; ("items", done, total) advances it;
#: ("share", worker, done, total) advances one worker's part of it (workers playing shares of the target, summed).
Event = tuple[Any, ...]

_sink: Callable[[Event], None] | None = None
#: Items events are sent at most this often, so a fast loop costs nothing.
_ITEM_INTERVAL_S = 0.2


def wanted(flag: bool) -> bool:
    """Whether to draw progress: asked for, stderr is a terminal, and not in CI."""
    return flag and not os.environ.get("CI") and sys.stderr.isatty()


def connect(sink: Callable[[Event], None] | None) -> None:
    """Send this process's events to ``sink`` (``None``: drop them)."""
    global _sink
    _sink = sink


def emit(*event: Any) -> None:
    """Send one event to the display, if this process has one."""
    if _sink is not None:
        try:
            _sink(tuple(event))
        except Exception:  # noqa: BLE001 - progress must never fail a conversion
            pass


def drawer(display: Display | None) -> Callable[[Event], None]:
    """Where this process's events go: ``display``, where it draws its own line (offline, one process), else
    :func:`emit` (to whoever draws: the launcher, or rank 0's display)."""
    return display if display is not None else (lambda event: emit(*event))


def only(kinds: tuple[str, ...], sink: Callable[[Event], None]) -> Callable[[Event], None]:
    """A sink that passes on events of ``kinds`` alone
    (a worker of several sends its share's progress, not its stages')."""
    return lambda event: sink(event) if event[0] in kinds else None


def track(items: Iterable[T], total: int | None = None) -> Iterator[T]:
    """Iterate ``items``, emitting how many are done (throttled)."""
    if _sink is None:
        yield from items
        return
    total = (
        total if total is not None else (len(items) if hasattr(items, "__len__") else None)  # type: ignore[arg-type]
    )
    counter = Counter(total)
    for item in items:
        yield item
        counter.advance()
    counter.finish()


class Counter:
    """Items done out of ``total``, emitted as they are done (throttled): for work whose loop another module drives."""

    def __init__(self, total: int | None) -> None:
        self.total, self.done, self._last = total, 0, 0.0

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last >= _ITEM_INTERVAL_S:
            emit("items", self.done, self.total)
            self._last = now

    def finish(self) -> None:
        emit("items", self.done, self.total)


class Display:
    """The live line: the current phase, its items, and the time it has taken. A no-op when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._shares: dict[int, tuple[int, int | None]] = {}
        self._shown = 0.0  # when amount() last drew

    def __call__(self, event: Event) -> None:
        """Take one event (the sink of :func:`connect`, or what the launcher received)."""
        if not self.enabled:
            return
        kind, *rest = event
        if kind == "phase":
            self._open(str(rest[0]), *rest[1:])
        elif kind == "items" and self._bar is not None:
            self._show(*rest)
        elif kind == "share" and self._bar is not None:
            worker, done, total = rest
            self._shares[worker] = (done, total)
            totals = [t for _, t in self._shares.values()]
            # a worker's total unknown yet: the whole's too
            self._show(sum(d for d, _ in self._shares.values()), None if None in totals else sum(totals))

    def _show(self, done: int, total: int | None) -> None:
        if total != self._bar.total:
            self._bar.total = total
        self._bar.n = done
        self._bar.refresh()

    def phase(self, text: str, unit: str = "item") -> None:
        self(("phase", text, unit))

    def amount(self, done: int, total: int | None) -> None:
        """``done`` of ``total`` in the current phase, drawn at most every :data:`_ITEM_INTERVAL_S` and when it is
        all done: for work this process does itself, told as it goes (a Megatron save's bytes read)."""
        now = time.monotonic()
        if self._bar is not None and (now - self._shown >= _ITEM_INTERVAL_S or done == total):
            self._shown = now
            self._show(done, total)

    def tick(self) -> None:
        """Redraw, so the elapsed time moves while nothing else happens."""
        if self._bar is not None:
            self._bar.refresh()

    def _open(self, text: str, unit: str = "item") -> None:
        self.close()
        self._shares, self._shown = {}, 0.0  # a new phase draws its first amount at once
        self._bar = tqdm(
            desc=f"osdpipe: {text}",
            total=None,
            leave=False,
            file=sys.stderr,
            unit=unit,
            unit_scale=unit == "B",
            dynamic_ncols=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
