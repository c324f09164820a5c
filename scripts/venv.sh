# Sourced by the README commands: creates or refreshes .venv, then activates it.
# Refreshes only when pyproject.toml or the constraints change (a stamp holds their hash).
set -e
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_venv="$_root/.venv"
_want=$(cat "$_root/pyproject.toml" "$_root/requirements/cpu-constraints.txt" | sha256sum | cut -c1-16)
if [ ! -x "$_venv/bin/python" ] || [ "$(cat "$_venv/.stamp" 2>/dev/null)" != "$_want" ]; then
    echo "setting up $_venv ..." >&2
    python3 -m venv "$_venv"
    "$_venv/bin/pip" install -q --upgrade pip
    "$_venv/bin/pip" install -q -c "$_root/requirements/cpu-constraints.txt" torch==2.13.0
    "$_venv/bin/pip" install -q -c "$_root/requirements/cpu-constraints.txt" -e "$_root[test]"
    echo "$_want" > "$_venv/.stamp"
fi
. "$_venv/bin/activate"
set +e
