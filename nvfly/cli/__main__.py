"""``python -m nvfly.cli``: the ``nvfly`` command."""
import sys

from nvfly.cli import main

sys.exit(main())
