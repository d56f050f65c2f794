"""``python -m exllama_integrations``."""

import sys

from .cli import main

sys.exit(main())
