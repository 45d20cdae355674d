#!/usr/bin/env bash
# Installs what mixkv builds and tests with, on a fresh Debian 12 machine.
# Idempotent: skips apt-get entirely when every package is already there.
set -euo pipefail

packages=(cmake ninja-build g++ libboost1.81-dev libgtest-dev libgmock-dev libbenchmark-dev
          python3-dev python3-pip)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
