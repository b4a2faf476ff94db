"""Launched by test_launch_errors: the trainer's command line where rank FAULT_RANK's data
is bad (its data set raises the UsageError MESSAGE naming a file) while the other ranks go on
into the first collectives.

Without torchrun's WORLD_SIZE it self-launches as ``python -m megatron.training`` does, but
re-running this module in the workers (so they get the fault); under torchrun it is one
worker. Arguments are the trainer's.
"""

import os
import sys

from megatron.training import cli
from megatron.training.errors import UsageError

FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
MESSAGE = "--data-path broken.jsonl: line 3: expected a JSON object, got 42"


def main() -> int:
    if "WORLD_SIZE" not in os.environ:  # the launcher: its workers run this module
        command = cli.launch_command
        cli.launch_command = lambda argv, nproc: [
            *command(argv, nproc)[: -1 - len(argv)],
            __spec__.name,
            *argv,
        ]
        return cli.main(sys.argv[1:])
    if int(os.environ["RANK"]) == FAULT_RANK:
        from megatron.training import training

        def bad_data(config):
            raise UsageError(MESSAGE)

        training.build_sft_dataset = bad_data
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
