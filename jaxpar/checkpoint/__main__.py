"""``python -m jaxpar.checkpoint {inspect,transform,merge} ...`` (same as ``jaxpar ckpt``)."""

import sys

from jaxpar.checkpoint.cli import main

sys.exit(main())
