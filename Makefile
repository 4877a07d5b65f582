# Two commands do everything on a fresh Debian machine: `make demo` and `make test`.
# Set-up installs only what is missing: apt packages (Vulkan loader, lavapipe, validation
# layers, npm), the naga wasm from npm, and a virtual environment with vkml and its test extra.

VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := libvulkan1 mesa-vulkan-drivers vulkan-validationlayers
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Tests run under the Khronos validation layer: any message it reports fails the test.
TEST_ENV := VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation

.PHONY: setup system-packages demo test lint clean

setup: system-packages node_modules/.installed $(VENV)/.installed

system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done; \
	  command -v npm >/dev/null || echo npm); \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $$missing; \
	fi

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

$(VENV)/.installed: pyproject.toml
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: setup
	$(PY) -m vkml demo

test: setup
	$(TEST_ENV) $(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check vkml tests tools

clean:
	rm -rf $(VENV) node_modules .pytest_cache
