"""``python -m comera_compile.cli``: the ``comera`` command."""

import sys

from comera_compile.cli import main

sys.exit(main())
