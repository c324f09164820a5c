# Sourced (from the repository root) by the scripts that run in one device call: $out (the call's
# $OUT), $py, $work (scratch), the repository importable as `deepinfer` (it is the package's root,
# not inside one), the wheels carried in .whl/ installed (the tokenizer packages the engine
# needs: the device machine has no index to install from), and unpack TARBALL FOLDER MARKER -> the
# directory inside holding MARKER.
out=${OUT:-out}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
work=$(mktemp -d)
mkdir -p "$work/pkg"
ln -s "$PWD" "$work/pkg/deepinfer"
export PYTHONPATH="$work/pkg${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl \
        && export PYTHONPATH="$work/site"${PYTHONPATH:+:$PYTHONPATH}
fi

unpack() {
    mkdir -p "$2"
    tar -xJf "$1" -C "$2"
    dirname "$(find "$2" -name "$3" | head -n 1)"
}
