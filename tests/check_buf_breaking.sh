#!/usr/bin/env bash
# Messages only ever gain fields: compare proto/ with the previous commit.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if ! git rev-parse -q --verify HEAD~1 >/dev/null; then
  echo "buf breaking: no previous commit to compare with (skipped)"
  exit 0
fi
npx --no-install buf breaking --against '.git#ref=HEAD~1'
echo "buf breaking: no breaking change against HEAD~1"
