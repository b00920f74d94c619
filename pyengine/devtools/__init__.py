"""Tools for developers of the engine that ship with it: ``pyengine simulate`` (the
scheduler thread on a random workload) and the fake executor it drives, the twin of the
scheduler crate's ``sim::fake_token``; tests and benches reuse both."""
