"""`python -m hf_dynamic_ckpt.cli`."""

import sys

from . import main

sys.exit(main())
