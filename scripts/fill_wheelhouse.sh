#!/usr/bin/env bash
# Fills a wheelhouse for `./install.sh --wheelhouse DIR` on a machine with no package index: the
# wheels of every requirement of resilient-rl (and of what they need) for one Python version and
# Linux x86-64, downloaded here, where pip reaches an index.
#
#   scripts/fill_wheelhouse.sh DIR [PYTHON_VERSION] [--with-torch] [--dev]
#
# PYTHON_VERSION defaults to this Python's (e.g. 3.12). torch is left out unless --with-torch:
# GPU clusters bring their own CUDA build of it. --dev adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: scripts/fill_wheelhouse.sh DIR [PYTHON_VERSION] [--with-torch] [--dev]}"
shift
pyver="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
with_torch=0; dev=0
for arg in "$@"; do
    case "$arg" in
        --with-torch) with_torch=1 ;;
        --dev) dev=1 ;;
        [0-9]*.[0-9]*) pyver="$arg" ;;
        *) echo "fill_wheelhouse.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done
mkdir -p "$dir"
reqs="$(python3 - "$with_torch" "$dev" <<'PY'
import sys
try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(project["dependencies"]) + ["setuptools>=77", "wheel"]
if sys.argv[2] == "1":
    reqs += project["optional-dependencies"]["dev"]
if sys.argv[1] != "1":
    reqs = [r for r in reqs if not r.replace(" ", "").startswith("torch")]
print("\n".join(reqs))
PY
)"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    platforms+=(--platform "$p")
done
echo "$reqs" > "$dir/requirements.txt"
# torch itself is a requirement of some of them (tensordict): resolved, not downloaded, without --with-torch.
if [ "$with_torch" = "0" ]; then no_torch=(--no-deps); else no_torch=(); fi
python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
    -d "$dir" -r "$dir/requirements.txt" "${no_torch[@]}"
if [ "$with_torch" = "0" ]; then
    # The requirements' own requirements, torch and its CUDA libraries aside.
    python3 - "$dir" "$pyver" <<'PY'
import subprocess, sys, zipfile, pathlib, re
folder, pyver = pathlib.Path(sys.argv[1]), sys.argv[2]
seen, todo = set(), list(folder.glob("*.whl"))
skip = re.compile(r"^(torch|nvidia-|triton)", re.I)
while todo:
    wheel = todo.pop()
    if wheel.name in seen:
        continue
    seen.add(wheel.name)
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    needs = [l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Dist:") and "extra ==" not in l]
    needs = [n for n in needs if not skip.match(n)]
    if not needs:
        continue
    before = set(folder.glob("*.whl"))
    plats = sum((["--platform", p] for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                              "manylinux2014_x86_64", "any")), [])
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", pyver,
                    "--implementation", "cp", *plats, "--no-deps", "-d", str(folder), *needs], check=False)
    todo += sorted(set(folder.glob("*.whl")) - before)
PY
fi
echo "fill_wheelhouse.sh: $(ls "$dir"/*.whl | wc -l) wheels for Python $pyver in $dir ($(du -sh "$dir" | cut -f1))"
