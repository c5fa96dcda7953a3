"""Bundle entry point of `strata`, the desktop app (PyInstaller runs this file as __main__)."""

import sys

from app.main import main

sys.exit(main())
