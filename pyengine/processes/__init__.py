"""Utilities for pyengine's own child processes (engine cores, tensor-parallel workers,
test processes): the command line that starts one, and the start-up heap they freeze."""
