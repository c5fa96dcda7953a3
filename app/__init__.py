"""PolyStrata desktop app (PySide6). Never imports torch or the engine: it talks to the engine over HTTP."""
