"""Tools built on the model, inference and training wings: ablations, accounting, verification
against the reference, upcycling."""
