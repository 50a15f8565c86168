"""What orbax and tensorstore print about a failure that jaxpar also raises, held back.

When one read or write of a step fails, orbax raises the error and also logs it (with a
traceback) from the thread it happened in; it closes its event loop at once, and tensorstore
then completes the operations still in flight into the closed loop: each prints a
"RuntimeError: Event loop is closed" traceback (``sys.unraisablehook``), an asyncio "exception
was never retrieved" log line, or the finalization error of an orbax coroutine. jaxpar reports
the failure as one error naming the step and the cause (`CheckpointDamagedError`,
`CheckpointWriteError`); `Echoes` keeps those echoes off the screen meanwhile. Anything else
goes to the hook and the handlers that were installed, and held orbax records are emitted
after all when no error was raised for them (nothing is silent).
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import time

_ORBAX = f"{os.sep}orbax{os.sep}"


def echo_of_failure(unraisable) -> bool:
    """An error Python could not raise that only echoes a failed orbax read or write."""
    if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
        return True
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and _ORBAX in code.co_filename


class Echoes(logging.Filter):
    """Installed (`install` / `remove`): drops the echoes of a failure, counting them; with
    ``hold_orbax``, also holds back orbax's ERROR records (its background threads log a failed
    save with a traceback before the save is waited for)."""

    def __init__(self, *, hold_orbax: bool = False):
        super().__init__()
        self.hold_orbax, self.count, self.held, self.hook, self.releasing = hold_orbax, 0, [], None, False

    def install(self) -> "Echoes":
        self.hook, sys.unraisablehook = sys.unraisablehook, self.unraisable
        logging.getLogger("asyncio").addFilter(self)
        if self.hold_orbax:
            logging.getLogger("absl").addFilter(self)
        return self

    def remove(self) -> None:
        if sys.unraisablehook == self.unraisable:   # else a later hook delegates to this one: leave it
            sys.unraisablehook = self.hook
        logging.getLogger("asyncio").removeFilter(self)
        logging.getLogger("absl").removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            echo = record.getMessage().endswith("exception was never retrieved")
            self.count += echo
            return not echo
        if self.hold_orbax and not self.releasing and record.levelno >= logging.ERROR and _ORBAX in record.pathname:
            self.held.append(record)
            return False
        return True

    def unraisable(self, unraisable) -> None:
        if echo_of_failure(unraisable):
            self.count += 1
        else:
            self.hook(unraisable)

    def drop_held(self) -> None:
        """The held records echo an error raised now: forget them."""
        self.held.clear()

    def emit_held(self) -> None:
        """No error was raised for the held records: show them after all."""
        held, self.held, self.releasing = self.held, [], True
        try:
            for record in held:
                logging.getLogger(record.name).handle(record)
        finally:
            self.releasing = False

    def settle(self, quiet: float = 0.05, limit: float = 2.0) -> None:
        """Finalize the failure's leftovers until none came for ``quiet`` seconds: operations
        still in flight in tensorstore's threads end within milliseconds on a local disk."""
        deadline, seen = time.monotonic() + limit, -1
        while seen != self.count and time.monotonic() < deadline:
            seen = self.count
            gc.collect()
            time.sleep(quiet)
            gc.collect()


def release_frames(error: BaseException | None) -> None:
    """Drop the tracebacks of ``error`` and its chain (the messages stay): their frames hold the
    failed operation's coroutines, which must be finalized now, not whenever the error is dropped."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def first_line(error: BaseException) -> str:
    """The first line of orbax's / tensorstore's message, without tensorstore's spec dump."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    line = text.splitlines()[0] if text.strip() else "no detail"
    return line.split(" [tensorstore_spec=")[0][:400]


def os_error(error: BaseException | None) -> tuple[int, str] | None:
    """``(errno, text)`` of the operating-system error behind ``error`` (an ``OSError`` in its
    chain, or tensorstore's ``[os_error_code='28']``), or ``None`` when there is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error.errno, str(error)
        code = re.search(r"os_error_code='(\d+)'", str(error))
        if code:
            path = re.search(r'(?:local file|Failed writing:) "([^"]+)"', str(error))
            return int(code[1]), f"[Errno {code[1]}] {os.strerror(int(code[1]))}" + (f": {path[1]!r}" if path else "")
        error = error.__cause__ or error.__context__
    return None
