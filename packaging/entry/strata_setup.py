"""Bundle entry point of `strata-setup`, the text-mode setup for headless PCs (PyInstaller runs this as __main__)."""

import sys

from installer.setup_cli import main

sys.exit(main())
