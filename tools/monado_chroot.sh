#!/usr/bin/env bash
# A real OpenXR runtime for the XR test: Monado (null compositor + simulated HMD) from Debian 13
# packages, in a Debian 13 chroot (Debian 12 has no Monado package). Cached OUTSIDE the repo, so
# only the first run pays for debootstrap (about 4 minutes, under 1 GB); later runs find it ready.
#
#   tools/monado_chroot.sh provision   # make the chroot if missing (needs root and the mirror)
#   tools/monado_chroot.sh root        # print the chroot's path
#   tools/monado_chroot.sh run-xr OUT [xr_demo options...]
#       stage this checkout's vkml and xr_demo (and the venv's pure-Python packages) into the
#       chroot, start monado-service there, run `python3 -m xr_demo --xr ...` inside, copy its
#       output folder to OUT, stop the service and unmount
#
# On success the chroot holds $ROOT/.vkml-ready; on failure $ROOT.status says why, and the XR
# test prints that reason when it skips. The mirror is the one apt already uses (read from the
# apt sources), never a fixed host.
set -uo pipefail

ROOT=${VKML_MONADO_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/vkml/monado-trixie}
STATUS="$ROOT.status"
PACKAGES="monado-service libopenxr1-monado libopenxr-loader1 mesa-vulkan-drivers libvulkan1
  vulkan-validationlayers python3 python3-cffi python3-numpy"

fail() { mkdir -p "$(dirname "$ROOT")"; echo "$*" > "$STATUS"; echo "monado_chroot: $*" >&2; exit 1; }

mirror() {
  # The first Debian archive (not -security) in apt's sources, deb822 or one-line format.
  local m
  m=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1)
  [ -n "$m" ] || m=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
      | awk '{print $2}' | grep -v security | head -1)
  echo "$m"
}

mounts() {  # what a Vulkan + Monado client needs inside: proc, sys, dev (shm for Monado's IPC)
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc" || return 1
  mountpoint -q "$ROOT/sys" || mount --rbind /sys "$ROOT/sys" || return 1
  mountpoint -q "$ROOT/dev" || mount --rbind /dev "$ROOT/dev" || return 1
  mount --make-rslave "$ROOT/sys" "$ROOT/dev" 2>/dev/null || true
}

unmounts() {
  for m in dev sys proc; do mountpoint -q "$ROOT/$m" && umount -R "$ROOT/$m"; done
  return 0
}

provision() {
  if [ -f "$ROOT/.vkml-ready" ]; then echo "monado chroot ready at $ROOT"; return 0; fi
  [ "$(id -u)" = 0 ] || fail "needs root (debootstrap, chroot, mount)"
  command -v debootstrap >/dev/null || { "$(dirname "$0")/apt_get_wait.sh" update -q >/dev/null && "$(dirname "$0")/apt_get_wait.sh" install -y -q debootstrap >/dev/null; } \
    || fail "cannot install debootstrap"
  local m; m=$(mirror)
  [ -n "$m" ] || fail "no Debian mirror found in apt's sources"
  mkdir -p "$(dirname "$ROOT")"
  if [ ! -x "$ROOT/bin/sh" ]; then
    rm -rf "$ROOT"
    echo "debootstrap trixie into $ROOT (a few minutes, once)"
    debootstrap --variant=minbase --include=ca-certificates trixie "$ROOT" "$m" \
      > "$ROOT.debootstrap.log" 2>&1 || fail "debootstrap failed (see $ROOT.debootstrap.log)"
  fi
  mounts || fail "cannot mount proc/sys/dev in $ROOT"
  trap unmounts EXIT
  # shellcheck disable=SC2086
  chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    --no-install-recommends $PACKAGES > "$ROOT.apt.log" 2>&1 \
    || { chroot "$ROOT" apt-get update -q >> "$ROOT.apt.log" 2>&1 \
         && chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
              --no-install-recommends $PACKAGES >> "$ROOT.apt.log" 2>&1; } \
    || fail "apt-get install in the chroot failed (see $ROOT.apt.log)"
  chroot "$ROOT" sh -c 'command -v monado-service && python3 -c "import cffi, numpy"' \
    > /dev/null || fail "monado-service or python3 modules missing after install"
  chroot "$ROOT" dpkg-query -W monado-service mesa-vulkan-drivers python3 > "$ROOT/.vkml-ready"
  rm -f "$STATUS"
  echo "monado chroot ready at $ROOT"
}

run_xr() {
  local out=${1:?usage: run-xr OUT [options]}; shift
  [ -f "$ROOT/.vkml-ready" ] || { echo "no Monado chroot at $ROOT: run '$0 provision'" >&2; return 3; }
  local repo; repo=$(cd "$(dirname "$0")/.." && pwd)
  local py=${VKML_VENV_PYTHON:-$repo/.venv/bin/python}
  local site; site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mounts || { echo "cannot mount proc/sys/dev in $ROOT" >&2; return 1; }
  local svc=""
  cleanup() {
    [ -n "$svc" ] && kill -- "-$svc" 2>/dev/null
    sleep 0.3
    unmounts
  }
  trap cleanup RETURN
  # The app inside: this checkout's packages, the naga wasm, and the pure-Python dependencies
  # (numpy and cffi come from the chroot's own Debian packages, built for its Python).
  rm -rf "$ROOT/opt/vkml" "$ROOT/opt/pylibs" "$ROOT/tmp/xr-out"
  mkdir -p "$ROOT/opt/vkml/node_modules/naga-wasm" "$ROOT/opt/pylibs" "$ROOT/tmp/xdg"
  chmod 700 "$ROOT/tmp/xdg"
  # package.json marks /opt/vkml as a checkout for vkml.vk.naga (which then finds the wasm in
  # node_modules/ as in this repo)
  cp -r "$repo/vkml" "$repo/xr_demo" "$repo/spirv" "$repo/package.json" "$ROOT/opt/vkml/"
  cp -r "$repo/node_modules/naga-wasm/dist" "$repo/node_modules/naga-wasm/package.json" \
    "$ROOT/opt/vkml/node_modules/naga-wasm/"
  # (with their dist-info: vkml keys its caches by package versions)
  for p in vulkan xr OpenGL wasmtime safetensors tqdm typing_extensions.py \
      vulkan-*.dist-info pyopenxr-*.dist-info wasmtime-*.dist-info safetensors-*.dist-info; do
    for f in "$site"/$p; do [ -e "$f" ] && cp -r "$f" "$ROOT/opt/pylibs/"; done
  done
  find "$ROOT/opt" -name __pycache__ -prune -exec rm -rf {} +
  # naga's SPIR-V is the same inside: reuse the host's cache rather than translate again
  local cache=${VKML_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vkml}
  if [ -d "$cache/spirv" ]; then
    mkdir -p "$ROOT/tmp/vkml-cache/spirv" && cp -ru "$cache/spirv/." "$ROOT/tmp/vkml-cache/spirv/"
  fi
  rm -f "$ROOT/tmp/xdg/monado_comp_ipc"
  # monado-service needs a pipe on stdin (epoll on /dev/null fails); its own process group,
  # so that cleanup ends exactly it and its `sleep`.
  setsid chroot "$ROOT" sh -c 'sleep 600 | XDG_RUNTIME_DIR=/tmp/xdg XRT_COMPOSITOR_NULL=1 \
    SIMULATED_ENABLE=1 monado-service' > "$out.monado.log" 2>&1 &
  svc=$!
  local i
  for i in $(seq 100); do [ -S "$ROOT/tmp/xdg/monado_comp_ipc" ] && break; sleep 0.1; done
  [ -S "$ROOT/tmp/xdg/monado_comp_ipc" ] || { echo "monado-service did not start" >&2; cat "$out.monado.log" >&2; return 4; }
  local rc=0
  chroot "$ROOT" env XDG_RUNTIME_DIR=/tmp/xdg PYTHONPATH=/opt/vkml:/opt/pylibs \
    VKML_CACHE_DIR=/tmp/vkml-cache HOME=/root ${VK_INSTANCE_LAYERS:+VK_INSTANCE_LAYERS=$VK_INSTANCE_LAYERS} \
    python3 -m xr_demo --xr --out /tmp/xr-out "$@" || rc=$?
  mkdir -p "$out"
  cp -r "$ROOT/tmp/xr-out/." "$out/" 2>/dev/null
  return $rc
}

case "${1:-provision}" in
  provision) provision ;;
  root) echo "$ROOT" ;;
  mount) mounts ;;
  unmount) unmounts ;;
  run-xr) shift; run_xr "$@" ;;
  *) echo "usage: $0 provision|root|mount|unmount|run-xr OUT [options]" >&2; exit 2 ;;
esac
