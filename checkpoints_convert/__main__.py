"""`python -m checkpoints_convert SRC OUT [--dtype bfloat16|float32] [--fingerprint sha256|size_mtime]
[--overwrite] [--workers N] [--no-progress]` (see checkpoints_convert.convert)."""

import sys

from checkpoints_convert.convert import main

sys.exit(main())
