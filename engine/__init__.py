"""PolyStrata inference engine (PyTorch). Never imports Qt."""
