"""The single version number of PolyStrata (app, engine, node agent, installer)."""

__version__ = "0.1.0"
