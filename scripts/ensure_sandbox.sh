#!/usr/bin/env bash
# Jobs (trainer agents) and generated programs (eval's code tasks) run in bubblewrap sandboxes,
# which need Debian's bubblewrap (bwrap) and util-linux (setpriv). `make install` and `make up`
# run this: installed as root when missing; otherwise it stops with the one command to run.
# FORGE_ALLOW_UNISOLATED=1 skips it (an explicit operator choice: agents then start only with
# FORGE_TRAINER_AGENT_JOB_SANDBOX='' and run admins' jobs only, and code tasks refuse to run).
set -euo pipefail

if [ "${FORGE_ALLOW_UNISOLATED:-0}" = "1" ]; then
  echo "WARNING: FORGE_ALLOW_UNISOLATED=1: not checking for bubblewrap; jobs and generated code will not be isolated" >&2
  exit 0
fi
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} (job and code sandboxes)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  command -v bwrap >/dev/null 2>&1 && exit 0
fi
echo "Forge isolates jobs and generated code with bubblewrap, which is missing here. Run:" >&2
echo "    sudo apt-get install -y ${missing[*]}" >&2
echo "(or, knowingly, FORGE_ALLOW_UNISOLATED=1 make ... to go on without isolation)" >&2
exit 1
