"""`python -m fp8rl ...` = the `fp8rl` command (what torchrun launches: `torchrun ... -m fp8rl train`)."""

import sys

from fp8rl.cli import main

sys.exit(main())
