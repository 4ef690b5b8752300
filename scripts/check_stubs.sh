#!/usr/bin/env bash
# The stub-freshness gate of `make verify`: regenerate every stub from protos/ and fail if the
# result differs from what git has — an edited proto without regenerated stubs, a hand-edited
# stub, or a generated file nobody committed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

scripts/gen_protos.sh
if ! git diff --quiet -- libs/protos; then
  echo "check_stubs: generated stubs differ from the committed ones (run scripts/gen_protos.sh and commit):" >&2
  git diff --stat -- libs/protos >&2
  exit 1
fi
untracked="$(git status --porcelain -- libs/protos)"
if [ -n "$untracked" ]; then
  echo "check_stubs: generated files not committed:" >&2
  echo "$untracked" >&2
  exit 1
fi
echo "check_stubs: stubs are up to date"
