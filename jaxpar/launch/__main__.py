"""``python -m jaxpar.launch ARGS`` runs ``jaxpar launch ARGS``."""

import sys

from jaxpar.cli import main

if __name__ == "__main__":
    sys.exit(main(["launch", *sys.argv[1:]]))
