"""Controllers: plain QObjects with state and signals, no widgets (the windows in app/ui are built on them)."""
