#!/usr/bin/env bash
# Installs the Debian packages named in hvdtrain/building/versions.env that are missing (Open MPI,
# compiler, cmake).
set -euo pipefail
# shellcheck source=../hvdtrain/building/versions.env
source "$(dirname "$0")/../hvdtrain/building/versions.env"
missing=()
for package in $DEBIAN_PACKAGES; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "hvdtrain: missing Debian packages; run: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "hvdtrain: installing Debian packages: ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
