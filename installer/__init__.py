"""Hardware facts, recommendations, configs and downloads shared by the app and the text setup (no torch, no Qt)."""
