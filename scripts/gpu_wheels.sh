#!/usr/bin/env bash
# gpu_wheels.sh: put the pure-python wheels that dhp needs and the GPU machine lacks into .whl/
# (ignored through .git/info/exclude); copy .whl/ to the GPU machine along with the tree, and
# scripts/gpu_check.sh installs them there with pip --no-index --target /tmp/site.
# The device image has torch, transformers, safetensors, tokenizers, rich, typer (+click,
# shellingham), pyyaml, pillow, numpy, scikit-image; it lacks hydra-core, omegaconf (+antlr4) and ray.
# antlr4-python3-runtime 4.9.3 (omegaconf's pin) exists only as an sdist: built into a wheel here.
# Ray is NOT included by default: its cp312 manylinux wheel is ~79 MB, over the 64 MiB this project
# allows for the tree + .whl/ copied to the GPU machine. `--try-ray` downloads it anyway and keeps it
# only if it fits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=python3
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"
mkdir -p .whl
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
HYDRA=$(ver hydra-core 1.3.2)
OMEGA=$(ver omegaconf 2.3.0)
ANTLR=$(ver antlr4-python3-runtime 4.9.3)
rm -f .whl/hydra_core-*.whl .whl/omegaconf-*.whl .whl/antlr4_python3_runtime-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl \
  "hydra-core==$HYDRA" "omegaconf==$OMEGA"
if ! "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl \
  "antlr4-python3-runtime==$ANTLR" 2>/dev/null; then
  "$PY" -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$ANTLR"
fi
if [[ ${1:-} == --try-ray ]]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$tmp" "ray==$(ver ray 2.40.0)"
  size=$(du -cb "$tmp"/*.whl | tail -1 | cut -f1)
  tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
  if ((size + tree + $(du -cb .whl/*.whl | tail -1 | cut -f1) < 60 * 1024 * 1024)); then
    mv "$tmp"/*.whl .whl/
  else
    echo "ray wheel is $((size >> 20)) MiB: with the tree it exceeds the 64 MiB budget for the tree + .whl/; not kept"
  fi
  rm -rf "$tmp"
fi
ls -l .whl/
du -ch .whl/*.whl | tail -1
