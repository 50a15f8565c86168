"""Test worker for ``jaxpar launch --servers`` (no JAX): records what it was given to reach
the servers, connects to each once, then waits for ``<out>/stop`` (or ``--fail``s)."""

import argparse
import json
import os
import socket
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="")
    p.add_argument("--fail", action="store_true", help="rank 1 exits 3 once it has reported")
    args = p.parse_args()
    rank = int(os.environ["JAXPAR_PROCESS_ID"])
    addresses = os.environ["JAXPAR_PS_ADDRESSES"].split(",")
    reached = []
    for address in addresses:  # every server serves before any worker starts
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5):
            reached.append(address)
    record = {"addresses": addresses, "reached": reached, "token": os.environ["JAXPAR_PS_TOKEN"]}
    # written whole, then renamed: a test polling for reports never reads a half-written one
    path = os.path.join(args.out, f"rank_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    if args.fail and rank == 1:
        sys.exit(3)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(args.out, "stop")) and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
