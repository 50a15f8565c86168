"""Test worker without JAX: rank 1 fails with a slow teardown, rank 0 dies *of* it first.

Rank 1 raises; its runner records the failure, then the flush of its output takes
``--slow-exit`` seconds (a large buffered log, say). Rank 0 waits for rank 1's ``end.1``
record and at once fails with a peer-failure error, so rank 0's process ends first: a
launcher that blames the first exit it sees names the wrong rank.
"""

import argparse
import os
import sys
import time


class SlowStderr:
    """Stderr whose flush takes ``delay`` seconds once armed."""

    def __init__(self, stream, delay: float):
        self._stream, self._delay, self.armed = stream, delay, False

    def write(self, text):
        return self._stream.write(text)

    def flush(self):
        if self.armed:
            time.sleep(self._delay)
        self._stream.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--tag", default="")
    p.add_argument("--slow-exit", type=float, default=2.0)
    args = p.parse_args()
    rank = int(os.environ["JAXPAR_PROCESS_ID"])
    record = os.path.join(os.environ["JAXPAR_LAUNCH_RUN_DIR"], "end.1")
    print(f"rank {rank}: started", flush=True)
    if rank == 1:
        time.sleep(0.5)
        sys.stderr = SlowStderr(sys.stderr, args.slow_exit)
        sys.stderr.armed = True
        raise ValueError("rank 1: the root cause")
    deadline = time.monotonic() + 30
    while not os.path.exists(record) and time.monotonic() < deadline:
        time.sleep(0.01)
    raise RuntimeError("Gloo: Connection closed by peer [127.0.0.1]:4242 (rank 0 of 2)")


if __name__ == "__main__":
    main()
