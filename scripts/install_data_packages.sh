#!/usr/bin/env bash
# Debian packages holding the reference corpus and evaluation data (see README "Data and licenses").
# The reference builder installs them itself when run as root; this script does it up front.
set -euo pipefail
need=()
command -v bible >/dev/null || need+=(bible-kjv)
[ -d /usr/share/doc/python3.11/html/_sources ] || need+=(python3.11-doc)
[ -d /usr/share/games/fortunes ] || need+=(fortunes)
[ -f /usr/share/wordnet/data.noun ] || need+=(wordnet-base)
[ -f /usr/share/dict/american-english-huge ] || need+=(wamerican-huge)
if [ ${#need[@]} -eq 0 ]; then
  echo "data packages present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing data packages; run: sudo apt-get update && sudo apt-get install -y --no-install-recommends ${need[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${need[@]}" || { apt-get update && apt-get install -y --no-install-recommends "${need[@]}"; }
