"""``python -m jaxpar.cli ARGS`` runs ``jaxpar ARGS``."""

import sys

from jaxpar.cli import main

if __name__ == "__main__":
    sys.exit(main())
