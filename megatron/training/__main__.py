"""``python -m megatron.training``: the main job's command line (see ``cli.main``)."""

import sys

from megatron.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
