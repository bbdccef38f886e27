#!/usr/bin/env bash
# Fills a wheelhouse for `./install.sh --wheelhouse DIR` on a machine with no package index: the
# wheels of every requirement of resilient-rl (and of what they need) for one Python version and
# Linux x86-64, downloaded here, where pip reaches an index.
#
#   scripts/fill_wheelhouse.sh DIR [PYTHON_VERSION] [--extras hf,s3,...] [--with-torch] [--dev] [--print-requirements]
#
# PYTHON_VERSION defaults to this Python's (e.g. 3.12). torch is left out unless --with-torch:
# GPU clusters bring their own CUDA build of it. --extras adds the requirements of extras of
# pyproject.toml (hf: Hugging Face models, s3: s3:// checkpoints, parquet, cluster, ...), which
# `./install.sh --wheelhouse DIR hf,s3` then installs; --dev adds the test dependencies (the dev
# extra). --print-requirements prints the top-level requirements and downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/fill_wheelhouse.sh DIR [PYTHON_VERSION] [--extras hf,s3,...] [--with-torch] [--dev]"
usage+=" [--print-requirements]"
dir="${1:?$usage}"
shift
pyver="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
with_torch=0; extras=""; print_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --with-torch) with_torch=1 ;;
        --dev) extras="${extras:+$extras,}dev" ;;
        --extras) extras="${extras:+$extras,}${2:?--extras needs a list of extras, e.g. hf,s3}"; shift ;;
        --extras=*) extras="${extras:+$extras,}${1#--extras=}" ;;
        --print-requirements) print_only=1 ;;
        [0-9]*.[0-9]*) pyver="$1" ;;
        *) echo "fill_wheelhouse.sh: unknown argument $1 ($usage)" >&2; exit 2 ;;
    esac
    shift
done
reqs="$(python3 - "$with_torch" "$extras" <<'PY'
import sys
try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(project["dependencies"]) + ["setuptools>=77", "wheel"]
known = project["optional-dependencies"]
for extra in filter(None, (e.strip() for e in sys.argv[2].split(","))):
    if extra not in known:
        sys.exit(f"fill_wheelhouse.sh: --extras {extra!r} is not an extra of pyproject.toml ({', '.join(known)})")
    reqs += [r for r in known[extra] if r not in reqs]
if sys.argv[1] != "1":
    reqs = [r for r in reqs if not r.replace(" ", "").startswith("torch")]
print("\n".join(reqs))
PY
)" || exit 2
if [ "$print_only" = "1" ]; then
    echo "$reqs"
    exit 0
fi
mkdir -p "$dir"
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
    # The requirements' own requirements, torch and its CUDA libraries aside, and those of the
    # extras a requirement asks for (ray[default]): their markers name the extra, which pip would
    # read as not asked for, so they are taken without their marker.
    python3 - "$dir" "$pyver" <<'PY'
import subprocess, sys, zipfile, pathlib, re
folder, pyver = pathlib.Path(sys.argv[1]), sys.argv[2]
seen, todo = set(), list(folder.glob("*.whl"))
skip = re.compile(r"^(torch|nvidia-|triton)", re.I)
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
wanted = {}  # project -> extras asked for in requirements.txt
for req in (folder / "requirements.txt").read_text().splitlines():
    m = re.match(r"\s*([\w.-]+)\s*\[([^\]]*)\]", req)
    if m:
        wanted.setdefault(norm(m.group(1)), set()).update(norm(e) for e in m.group(2).split(","))
while todo:
    wheel = todo.pop()
    if wheel.name in seen:
        continue
    seen.add(wheel.name)
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    name = norm(next((l.split(":", 1)[1].strip() for l in lines if l.startswith("Name:")), ""))
    needs = []
    for l in lines:
        if not l.startswith("Requires-Dist:"):
            continue
        need = l.split(":", 1)[1].strip()
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", need)
        if extra is None:
            needs.append(need)
        elif norm(extra.group(1)) in wanted.get(name, ()):
            needs.append(need.split(";", 1)[0].strip())
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
