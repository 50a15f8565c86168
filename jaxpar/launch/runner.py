"""Runs one worker's Python script under ``jaxpar launch`` and records how it ended.

``python jaxpar/launch/runner.py script.py ARGS`` runs ``script.py`` as ``python script.py
ARGS`` would (``__name__ == "__main__"``, ``sys.argv``, the script's folder first on
``sys.path``), then writes ``end.<rank>`` into the launcher's run folder: the exit code, the
time, and the tail of the traceback. It imports only the standard library, so the script still
sets JAX's environment variables before JAX is imported. The launcher reads these records to name the rank whose
failure came first, not the peers that failed because of it.

How the script ends decides how the process ends:

* returns, or ``sys.exit(0)``: a normal exit, so JAX's shutdown barrier lets all ranks leave
  together (the launcher stops a rank that waits there longer than ``--exit-time-out``);
* raises, or ``sys.exit(n)`` with ``n != 0``: the traceback is printed, output flushed, and the
  process leaves at once with ``os._exit`` (status 1, or ``n``). A failed rank must not sit in
  the shutdown barrier while its peers wait for it inside a collective.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback

RUN_DIR = "JAXPAR_LAUNCH_RUN_DIR"
PROCESS_ID = "JAXPAR_PROCESS_ID"
TAIL_LINES = 30


def _exit_code(code: object) -> tuple[int, str]:
    """``SystemExit.code`` → (status, message to print), as the interpreter would do it."""
    if code is None:
        return 0, ""
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF, ""
    return 1, f"{code}\n"


def _script_frames(err: BaseException):
    """The traceback without this runner's and runpy's frames: what ``python script.py`` shows."""
    tb = err.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def run_script(script: str, args: list[str]) -> tuple[int, str, str]:
    """Runs ``script`` with ``args``; returns (status, how it ended, text to record)."""
    if not os.path.isfile(script):
        message = f"{sys.executable}: can't open file {os.path.abspath(script)!r}: no such file\n"
        sys.stderr.write(message)
        return 2, "exit", message
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code, message = _exit_code(stop.code)
        sys.stderr.write(message)
        return code, "exit", message or f"sys.exit({stop.code!r})"
    except BaseException as err:  # noqa: BLE001 - everything a script can raise ends the rank
        text = "".join(traceback.format_exception(type(err), err, _script_frames(err)))
        sys.stderr.write(text)
        return (130 if isinstance(err, KeyboardInterrupt) else 1), "exception", text
    return 0, "return", ""


def record_end(code: int, how: str, text: str) -> None:
    """Writes ``end.<rank>`` (JSON) into the launcher's run folder, if there is one."""
    run_dir, rank = os.environ.get(RUN_DIR), os.environ.get(PROCESS_ID)
    if not run_dir or rank is None or not os.path.isdir(run_dir):
        return
    record = {"rank": int(rank), "code": code, "how": how, "time": time.time(),
              "tail": text.splitlines()[-TAIL_LINES:]}
    path = os.path.join(run_dir, f"end.{rank}")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # the launcher never reads half a record


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def main(argv: list[str]) -> None:
    """Entry point: ``argv`` is ``[script, *args]``."""
    if not argv:
        sys.stderr.write("usage: python jaxpar/launch/runner.py SCRIPT [ARGS...]\n")
        sys.exit(2)
    code, how, text = run_script(argv[0], argv[1:])
    record_end(code, how, text)
    _flush()
    if code != 0:
        os._exit(code)  # skip JAX's shutdown barrier: the peers cannot finish without us
    # A normal end falls through to the interpreter's exit, and JAX's orderly shutdown.


if __name__ == "__main__":
    main(sys.argv[1:])
