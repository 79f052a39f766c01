#!/usr/bin/env bash
# Installs `prometheus` and `promtool` (Debian's prometheus package) when either is missing: the
# end-to-end suite starts a real Prometheus of its own, and make test-deploy runs promtool.
# Idempotent; starts no system daemon: a policy-rc.d that refuses service starts is in place for
# the install (unless the machine already has one, as container images do), so the package's
# post-install leaves prometheus.service stopped. The tests bind a free port of their own either way.
set -euo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "prometheus and promtool are needed (make test-deploy, the e2e suite); install them: https://prometheus.io/download/" >&2
  exit 1
fi

as_root=()
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "installing prometheus needs root (or sudo): apt-get install prometheus" >&2; exit 1; }
  as_root=(sudo)
fi

echo "== prometheus and promtool (Debian's prometheus package, no daemon started)"
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\n# make setup: no service starts while prometheus installs\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
  "${as_root[@]}" chmod 755 "$policy"
  trap '"${as_root[@]}" rm -f "$policy"' EXIT
fi
install=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus)
"${install[@]}" >/dev/null || { "${as_root[@]}" apt-get update -qq && "${install[@]}" >/dev/null; }
