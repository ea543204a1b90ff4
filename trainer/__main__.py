"""``python -m trainer``: see trainer/config.py for the flags and environment variables."""

import json
import logging

from trainer import shutdown
from trainer.config import from_args
from trainer.local.log_policy import quiet_libraries
from trainer.run import run


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_libraries()
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so that run() stops its child servers;
    # a watchdog ends the process and its children if unwinding takes longer than a few seconds.
    shutdown.install()
    summary = run(from_args())
    if summary:  # rank 0 (or the only process) has the run's summary
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
