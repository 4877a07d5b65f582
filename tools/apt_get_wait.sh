#!/bin/sh
# apt-get "$@", waiting for another apt or dpkg (unattended-upgrades, a second `make setup`) to
# finish instead of failing at once with "Could not get lock".
#
# apt waits for dpkg's lock itself when given DPkg::Lock::Timeout, but not for every lock: apt
# 2.6's `apt-get update` fails at once on /var/lib/apt/lists/lock. So a run that fails on a lock
# is retried until APT_LOCK_WAIT seconds (default 600) have passed; any other failure is returned
# at once, with apt's own message.
wait_s=${APT_LOCK_WAIT:-600}
retry_s=${APT_LOCK_RETRY:-5}
log=$(mktemp) || exit 1
trap 'rm -f "$log" "$log.rc"' EXIT
start=$(date +%s)
while :; do
  # Output is shown as it comes and kept, to tell a lock failure from any other.
  { apt-get -o DPkg::Lock::Timeout="$wait_s" "$@" 2>&1; echo $? >"$log.rc"; } | tee "$log"
  rc=$(cat "$log.rc")
  [ "$rc" = 0 ] && exit 0
  grep -q 'Could not get lock' "$log" || exit "$rc"
  if [ $(($(date +%s) - start)) -ge "$wait_s" ]; then
    echo "apt_get_wait: another apt or dpkg still holds its lock after ${wait_s}s; giving up" >&2
    exit "$rc"
  fi
  echo "apt_get_wait: another apt or dpkg holds its lock; trying again in ${retry_s}s" >&2
  sleep "$retry_s"
done
