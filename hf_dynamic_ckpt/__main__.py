"""`python -m hf_dynamic_ckpt` (the same as `hf-dynamic-ckpt` and `python -m hf_dynamic_ckpt.cli`)."""

import sys

from .cli import main

sys.exit(main())
