"""Bundle entry point of `strata-node`, the node agent (PyInstaller runs this file as __main__)."""

import multiprocessing
import sys


def _main() -> int:
    # A frozen executable re-runs itself for spawned child processes: such a child runs its task here and exits,
    # before the agent's imports.
    multiprocessing.freeze_support()
    from engine.node.cli import main

    return main()


sys.exit(_main())
