"""The app's only HTTP code: `EngineClient` (the local engine's API) and `NodeClient` (the node agents)."""
