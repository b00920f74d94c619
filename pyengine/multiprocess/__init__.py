"""Engine cores in processes of their own, behind one front end (``MultiprocessEngine``).

Nothing is imported here: an engine-core process imports what it runs and no more."""
