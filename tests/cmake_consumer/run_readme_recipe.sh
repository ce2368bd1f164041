#!/usr/bin/env bash
# Run README.md's C++ recipe (the ```bash block after the "<!-- cpp-recipe" marker) verbatim, as a user would
# after `make demo`: in a temporary folder that holds this checkout's .venv and examples/ (so build-example/ is
# created there, not in the checkout), then the built program once more through examples/cpp/run_ranks.sh (the
# README's launcher without torchrun). Registered as the ctest test readme_cpp_recipe.
#
#   run_readme_recipe.sh PROJECT_DIR HAVE_GLOO_HEADERS
#
# Exit 77 (skipped) when this build cannot create Gloo groups in C++ (no gloo headers; see README's Set up).
set -euo pipefail
ROOT=${1:?usage: run_readme_recipe.sh PROJECT_DIR HAVE_GLOO_HEADERS}
HAVE_GLOO=${2:-}
if [[ -z $HAVE_GLOO || $HAVE_GLOO == *NOTFOUND* ]]; then
  echo "skipped: no gloo headers in this build, so the C++ example cannot create its Gloo groups"
  exit 77
fi
[[ -f $ROOT/.venv/bin/activate ]] || { echo "no $ROOT/.venv: run make demo first"; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardtensor-readme.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ln -s "$ROOT/.venv" "$WORK/.venv"
ln -s "$ROOT/examples" "$WORK/examples"
"$ROOT/.venv/bin/python" - "$ROOT/README.md" "$WORK/recipe.sh" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"<!-- cpp-recipe.*?-->\s*```bash\n(.*?)```", text, re.S)
if not m:
    sys.exit("README.md has no <!-- cpp-recipe --> bash block")
open(sys.argv[2], "w").write(m.group(1))
PY
echo "-- README recipe:"
cat "$WORK/recipe.sh"
# A venv made by make demo has bin/torchrun; one that links another environment's packages may not: then the
# same launcher is taken from python -m (behind .venv/bin on PATH, so a real torchrun wins).
mkdir "$WORK/fallback-bin"
printf '#!/usr/bin/env bash\nexec python -m torch.distributed.run "$@"\n' > "$WORK/fallback-bin/torchrun"
chmod +x "$WORK/fallback-bin/torchrun"
cd "$WORK"
PATH="$PATH:$WORK/fallback-bin" bash -euo pipefail recipe.sh 2>&1 | tee "$WORK/recipe.log"
# Under torchrun the program must join the agent's store, not try to serve MASTER_PORT a second time.
if grep -q "failed to bind" "$WORK/recipe.log"; then
  echo "FAILED: the program tried to serve torchrun's store port itself (see 'failed to bind' above)"
  exit 1
fi
echo "-- the same program through examples/cpp/run_ranks.sh 2"
"$ROOT/examples/cpp/run_ranks.sh" 2 "$WORK/build-example/train_conv"
