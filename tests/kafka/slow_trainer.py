"""`consumers.trainer` whose updates are slow, for tests that kill a trainer while a step runs.

Before each update (`Learner.train_step` with `apply`) it writes the step's number (the
learner's update count + 1) to `$MILES_TEST_STEP_MARKER` and sleeps `$MILES_TEST_STEP_SLEEP_S`,
so a test sees when a step is under way and has time to kill it there. Test-only: the library
has no slow-step switch.
"""

import os
import sys
import time
from pathlib import Path

from miles.trainer.learner import Learner


def slowed(train_step):
    def train_step_slowly(self, groups, **options):
        if options.get("apply", True):
            Path(os.environ["MILES_TEST_STEP_MARKER"]).write_text(str(self.steps + 1))
            time.sleep(float(os.environ.get("MILES_TEST_STEP_SLEEP_S", "5")))
        return train_step(self, groups, **options)

    return train_step_slowly


if __name__ == "__main__":
    Learner.train_step = slowed(Learner.train_step)
    from consumers.trainer import main

    sys.exit(main())
