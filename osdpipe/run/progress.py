"""Progress on long work: one live line on the launcher's terminal, fed by events from rank 0.

Ranks never draw: rank 0 *emits* events (a stage begins, n of m items done)
through :func:`emit` and :func:`track`, and whoever draws receives them. In a
local world that is the launcher, which gets them through a queue and also
draws its own phases (starting a world, generating the source); under
torchrun rank 0 draws them itself. So there is one display per run, never two
processes writing over each other's line.

The line is drawn with tqdm (rate and elapsed time are solved there; rich
would bring a rendering stack osdpipe does not otherwise need), only when
stderr is a terminal and ``CI`` is unset. Its width is the terminal's, read
again at each draw (:func:`line_width`), and never its height: tqdm's own
(``dynamic_ncols``) took both from the size the terminal reports, and a
terminal that reports none (0 x 0: a pseudo-terminal whose size was never
set) or fewer than 3 rows made it draw nothing at all, as if the line were a
nested bar below the screen. Which terminal it is (``TERM``: tmux's, screen's)
plays no part.
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
#: The line's width where the terminal reports none (nor ``COLUMNS``): a terminal's usual.
DEFAULT_COLUMNS = 80
#: The screen height tqdm is told: its one line is never a nested bar beyond the screen, which tqdm hides.
_ROWS = 1 << 16


def wanted(flag: bool) -> bool:
    """Whether to draw progress: asked for, stderr is a terminal, and not in CI."""
    return flag and not os.environ.get("CI") and sys.stderr.isatty()


def line_width() -> int:
    """The live line's width: the terminal's columns (stderr's; ``COLUMNS`` or :data:`DEFAULT_COLUMNS` where it
    reports none), less one, since a line as wide as the terminal wraps in some."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):  # not a terminal, closed, or replaced by an object without a file
        columns = 0
    if columns <= 1:
        given = os.environ.get("COLUMNS", "")
        columns = int(given) if given.isdigit() and int(given) > 1 else DEFAULT_COLUMNS
    return columns - 1


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
        self._draw()

    def _draw(self) -> None:
        """Redraw the line at the terminal's width now (it may have been resized)."""
        self._bar.ncols = line_width()
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
            self._draw()

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
            ncols=line_width(),
            nrows=_ROWS,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
