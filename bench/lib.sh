# Shared by bench/run and bench/pgo, which source it after setting `script` to their own name:
# their messages, and Debian packages installed when a tool is missing.

say() { printf '== %s\n' "$*" >&2; }
die() { printf '%s: %s\n' "$script" "$*" >&2; exit 1; }

apt_install() { # PACKAGE: from Debian's packages (root, or sudo when not)
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  say "install $1 (Debian package)"
  $sudo apt-get install -y -qq "$1" >/dev/null 2>&1 ||
    { $sudo apt-get update -qq && $sudo apt-get install -y -qq "$1" >/dev/null; } ||
    die "$1 is not installed and could not be installed"
}
