#!/usr/bin/env bash
# The Debian programs some tests drive: Chromium (the rater UI's browser tests), libfaketime (the
# fault suite skews a service's clock) and promtool (package prometheus: the alert rules' unit
# tests; its daemon is not started). `make test` runs this: installed as root where missing;
# otherwise it says which command installs them and goes on (those tests skip, saying why).
set -uo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} (programs the tests drive)"
  apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    && exit 0
fi
echo "WARNING: ${missing[*]} missing: the tests that need them skip. To run them: sudo apt-get install -y ${missing[*]}" >&2
exit 0
