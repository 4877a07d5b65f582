# Two commands do everything on a fresh Debian machine: `make demo` and `make test`.
# Set-up installs only what is missing: apt packages (Vulkan loader, lavapipe, validation
# layers, Xvfb for the window test, npm), the naga wasm from npm, and a virtual environment with
# vkml, its test extra and the demo extra (glfw, pyopenxr, Pillow, matplotlib: xr_demo/ only).

VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := libvulkan1 mesa-vulkan-drivers vulkan-validationlayers xvfb
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# apt-get that waits (up to 10 minutes) for another apt or dpkg instead of failing at once.
APT_GET := $(SUDO) tools/apt_get_wait.sh
# Tests run under the Khronos validation layer: any message it reports fails the test.
TEST_ENV := VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation
# PyTorch is only the tests' reference. On Linux x86_64, PyPI's build of the pinned torch is the
# CUDA one (about 2.7 GB with its nvidia-* wheels). TORCH_INDEX_URL takes torch (and its own
# dependencies) from another index first, e.g. the CPU-only build (about 0.2 GB):
#   make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# It takes effect when .venv/ is set up: `make clean` first where one exists.
TORCH_INDEX_URL ?=
TORCH_PIN := $(shell sed -n 's/.*"\(torch==[^"]*\)".*/\1/p' pyproject.toml)

.PHONY: setup system-packages demo demo-mlp monado test lint clean

setup: system-packages node_modules/.installed $(VENV)/.installed

system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done; \
	  command -v npm >/dev/null || echo npm); \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing"; \
	  $(APT_GET) update -q && $(APT_GET) install -y -q $$missing; \
	fi

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

$(VENV)/.installed: pyproject.toml
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_INDEX_URL),$(PY) -m pip install -q --index-url '$(TORCH_INDEX_URL)' '$(TORCH_PIN)')
	$(PY) -m pip install -q -e '.[test,demo,bench]'
	touch $@

# The headless demo: the depth network learns live between the host renderer's frames (see
# README, "The demo"); pictures, plot and metrics go to out/xr_demo/.
DEMO_ARGS ?= --checkpoint assets/depthnet64.safetensors --fresh-decoder --compare
demo: setup
	$(PY) -m xr_demo --headless $(DEMO_ARGS)

# The MLP quickstart (python -m vkml demo).
demo-mlp: setup
	$(PY) -m vkml demo

# A real OpenXR runtime for the XR test: Monado in a Debian 13 chroot, cached outside the repo
# (~/.cache/vkml/monado-trixie). Never fails the build: where it cannot be made, the XR test is
# skipped and prints why.
monado:
	@tools/monado_chroot.sh provision || echo "Monado chroot not provisioned: the XR test will be skipped"

test: setup
	$(TEST_ENV) $(PY) -m pytest -q -rs

lint: setup
	$(VENV)/bin/ruff check vkml tests tools xr_demo

clean:
	rm -rf $(VENV) node_modules .pytest_cache
