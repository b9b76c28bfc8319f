"""``python -m meshlm``: the same as the ``meshlm`` command."""

import sys

from .cli import main

sys.exit(main())
