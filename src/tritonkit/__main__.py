"""``python -m tritonkit``: the ``tritonkit`` command."""

import sys

from tritonkit.cli import main

sys.exit(main())
