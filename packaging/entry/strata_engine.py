"""Bundle entry point of `strata-engine` (PyInstaller runs this file as __main__)."""

import multiprocessing
import sys


def _main() -> int:
    # A frozen executable re-runs itself for spawned child processes: such a child runs its task here and exits,
    # before the engine's imports.
    multiprocessing.freeze_support()
    from engine.cli import main

    return main()


sys.exit(_main())
