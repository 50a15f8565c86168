"""Test double of ``jaxpar.ps.server`` for the launcher's process management (no JAX, no rows).

It keeps the server contract the launcher relies on: takes ``--index --count --bind
--checkpoint-dir``, listens on the ``--bind`` port, prints ``jaxpar-ps-server ready HOST:PORT``,
and on SIGTERM writes its "final checkpoint" and exits 0. Each start writes
``start_<index>_<pid>.json`` (argv, the variables the launcher gave it) into the checkpoint
folder, so a test can compare a restart's arguments with the first start's.
``FAKE_PS_SILENT=<index>`` makes that server never print its ready line.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--index", "--count"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--bind", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    args = p.parse_args()
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    keep = ("JAXPAR_PS_TOKEN", "JAX_PLATFORMS", "JAXPAR_COORDINATOR_ADDRESS", "JAXPAR_PROCESS_ID")
    record = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keep}}
    with open(os.path.join(args.checkpoint_dir, f"start_{args.index}_{os.getpid()}.json"), "w") as f:
        json.dump(record, f)
    host, _, port = args.bind.rpartition(":")
    listener = socket.create_server((host, int(port)))  # the port the launcher handed out is usable

    def final_checkpoint(signum, frame):
        with open(os.path.join(args.checkpoint_dir, f"final_{args.index}.json"), "w") as f:
            json.dump({"pid": os.getpid()}, f)
        sys.exit(0)

    signal.signal(signal.SIGTERM, final_checkpoint)
    if os.environ.get("FAKE_PS_SILENT") != str(args.index):
        print(f"jaxpar-ps-server ready {args.bind}", flush=True)
    listener.settimeout(0.1)
    while True:
        try:
            conn, _ = listener.accept()
            conn.close()
        except socket.timeout:
            time.sleep(0.01)


if __name__ == "__main__":
    main()
