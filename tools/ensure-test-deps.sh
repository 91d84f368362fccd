#!/usr/bin/env bash
# System tools the test suite needs besides the venv: systemd-analyze (unit verify/security tests).
# Debian/Ubuntu only; a no-op when everything is already there. Tests never install anything.
set -euo pipefail
if ! command -v systemd-analyze >/dev/null; then
  SUDO=$([[ $(id -u) == 0 ]] || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq systemd >/dev/null
fi
