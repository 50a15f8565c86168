"""Test worker: ``jaxpar train --config JOB ...`` as one rank of a ``jaxpar launch`` job.

The launcher test helper appends ``--out DIR --tag TAG``; the rest goes to the command.
"""

import argparse
import sys

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--tag")
    _, rest = p.parse_known_args()
    from jaxpar.cli import main

    sys.exit(main(["train", *rest]))
