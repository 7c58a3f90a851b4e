"""``python -m remote_loader``: the ``remote-loader`` command line."""

import sys

from remote_loader.cli import main

sys.exit(main())
