#!/usr/bin/env bash
# Wheels the lent GPU machine needs for bench/gpu_check.sh, fetched here (the GPU box has no network).
#
#   bash bench/gpu_wheels.sh            download them into .whl/ (git-ignored), print sizes and totals
#   bash bench/gpu_wheels.sh --list     print the needed set (NAME==VERSION per line), download nothing
#   bash bench/gpu_wheels.sh --verify   dry-install .whl/*.whl for cp312 manylinux into a clean
#                                       --target and check what it holds (no download)
#
# What is carried: the packages that gpu_check.sh's steps import (ALLOW below, each with its reason)
# minus those the GPU image already has (bench/gpu_image_packages.txt), at the versions pinned in
# requirements.lock. Never torch, triton, numpy or anything else of the image: a second torch would
# blow the 64 MiB carry limit and shadow the image's CUDA build.
# Every download is cp312 (the image's Python 3.12.3) for manylinux x86_64 or pure Python
# (--only-binary=:all: --no-deps); a package with no such build fails the script, naming it. After
# the download each wheel's Requires-Dist (extras left out, markers evaluated for CPython 3.12 on
# Linux) must be in the image or in the carried set, else the script fails naming what is missing.
# The carried tree is what `run` sends: the repo's tracked and untracked-not-ignored files plus
# .whl/, at most 64 MiB in all; the script fails when repo + wheels reach it.
#
# Carry them with  run(carry=[".whl"], command="bash bench/gpu_check.sh")  (gpu_check.sh installs
# .whl/*.whl into a temporary --target and puts it on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=download
case "${1:-}" in
  "") ;;
  --list) MODE=list ;;
  --verify) MODE=verify ;;
  -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
  *) echo "usage: bash bench/gpu_wheels.sh [--list|--verify]" >&2; exit 2 ;;
esac

# What the GPU checks import that a plain `python3` on the image may lack. Keep it minimal: every MiB
# here travels on every call. Name -> why (checked against the image list below, so an entry the
# image already has is simply not carried).
ALLOW=(
  "omegaconf:common/config.py (every train CLI and the train bench's model config); omegaconf 2.4 vendors its ANTLR parser (no antlr4 runtime wheel needed)"
  "webdataset:data.synth writes the smoke run's shards; common/data reads tar shards"
  "braceexpand:common/data/shards.py (shard patterns); also a webdataset requirement"
  "open_clip_torch:common/nn/text_encoder.py, the frozen text tower of the FSDP smoke run"
  "ftfy:open_clip's tokenizer imports it"
  "wcwidth:ftfy's requirement"
  "torchao:fp8 training (common/precision/fp8.py) in the train bench's fp8 variants"
)
# Left out on purpose (in requirements.lock, not in the image): diffusers (only with vae.path; the
# bench feeds random latents), av (video decode, 35 MiB; no video step), trimesh (text23d only),
# pyarrow is in the image; pydantic/typer/rich stacks are not imported by these steps.
NEVER="torch triton numpy torchvision torchaudio"

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHL=.whl
LIMIT=$((64 * 1024 * 1024))
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pip matches manylinux_2_N exactly: list the other N the image's glibc (2.39, Ubuntu 24.04) runs too.
for n in 5 6 7 8 9 10 11 12 13 14 15 16 18 19 20 21 22 23 24 25 26 29 30 31 32 33 34 35 36 37 38 39; do
  PLATFORMS+=(--platform "manylinux_2_${n}_x86_64")
done
PLATFORMS+=(--platform manylinux2010_x86_64)
TARGET_ARGS=(--python-version 3.12 --implementation cp --only-binary=:all: "${PLATFORMS[@]}")

norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }

# name==version of what the lock pins, normalised names
lock_version() {
  local want; want=$(norm "$1")
  while IFS= read -r line; do
    line=${line%%#*}; line=${line// /}
    [ -z "$line" ] && continue
    local n=${line%%==*} v=${line#*==}
    if [ "$(norm "$n")" = "$want" ]; then echo "$v"; return 0; fi
  done < requirements.lock
  return 1
}

in_image() {
  local want; want=$(norm "$1")
  grep -v '^#' bench/gpu_image_packages.txt | sed 's/==.*//' | tr 'A-Z_.' 'a-z--' | grep -qx "$want"
}

NEEDED=()
for entry in "${ALLOW[@]}"; do
  name=${entry%%:*}
  for bad in $NEVER; do
    if [ "$(norm "$name")" = "$bad" ]; then echo "gpu_wheels: $name must never be carried" >&2; exit 1; fi
  done
  if in_image "$name"; then
    echo "# $name: in the GPU image, not carried" >&2
    continue
  fi
  if ! v=$(lock_version "$name"); then
    echo "gpu_wheels: ERROR: $name is not pinned in requirements.lock" >&2
    exit 1
  fi
  NEEDED+=("$name==$v")
done

if [ "$MODE" = list ]; then
  printf '%s\n' "${NEEDED[@]}"
  exit 0
fi

repo_bytes() {  # what `run` sends besides carried paths: tracked + untracked-not-ignored files
  { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 -r stat -c %s -- 2>/dev/null \
    | awk '{s += $1} END {print s + 0}'
}
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }

report_sizes() {
  local total=0 sz f
  echo "wheels in $WHL/:"
  for f in "$WHL"/*.whl; do
    sz=$(stat -c %s "$f")
    total=$((total + sz))
    printf '  %-78s %10d  %s\n' "$(basename "$f")" "$sz" "$(mib "$sz")"
  done
  local repo; repo=$(repo_bytes)
  printf '  %-78s %10d  %s\n' "TOTAL wheels" "$total" "$(mib "$total")"
  printf '  %-78s %10d  %s\n' "repo (tracked + untracked-not-ignored files)" "$repo" "$(mib "$repo")"
  printf '  %-78s %10d  %s   (limit 64 MiB)\n' "repo + wheels (what one run call carries)" "$((repo + total))" \
    "$(mib $((repo + total)))"
  if [ "$total" -ge "$LIMIT" ] || [ $((repo + total)) -ge "$LIMIT" ]; then
    echo "gpu_wheels: ERROR: over the 64 MiB carry limit" >&2
    return 1
  fi
}

# Requires-Dist closure: every requirement of a carried wheel is in the image or carried.
check_requirements() {
  "$PY" - "$WHL" bench/gpu_image_packages.txt <<'EOF'
import glob, re, sys, zipfile
from email.parser import Parser
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

def norm(n): return re.sub(r"[-_.]+", "-", n).lower()
whl_dir, image_list = sys.argv[1:3]
image = {norm(ln.split("==")[0].strip()) for ln in open(image_list) if ln.strip() and not ln.startswith("#")}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
carried, reqs = {}, []
for path in sorted(glob.glob(f"{whl_dir}/*.whl")):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    name = norm(msg["Name"])
    if name in carried:
        sys.exit(f"gpu_wheels: ERROR: two wheels of {name} ({carried[name]}, {path}): the install would stop")
    carried[name] = path
    for r in msg.get_all("Requires-Dist") or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(env):
            reqs.append((name, req))
missing = [(who, str(r)) for who, r in reqs if norm(r.name) not in image and norm(r.name) not in carried]
for who, r in reqs:
    where = "carried" if norm(r.name) in carried else "image" if norm(r.name) in image else "MISSING"
    print(f"  requires: {who} -> {r}  [{where}]")
if missing:
    sys.exit("gpu_wheels: ERROR: requirements neither in the GPU image nor carried: "
             + ", ".join(f"{r} (for {who})" for who, r in missing))
print(f"requirements closed: {len(carried)} wheels, every requirement in the image or carried")
EOF
}

# What gpu_check.sh's steps import, imported here from the dry-installed target with every
# package that is neither in the GPU image's list nor carried hidden (an import of one raises
# ModuleNotFoundError, as it would there): proves the names are covered, not the image's versions.
# Needs a python with torch (the project's .venv); skipped otherwise or with GPU_WHEELS_IMPORTS=0.
import_check() {
  if [ "${GPU_WHEELS_IMPORTS:-1}" = 0 ] || ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "import check skipped (no torch in $PY, or GPU_WHEELS_IMPORTS=0)"
    return 0
  fi
  echo "import check: the GPU steps' modules with only the image's packages + the carried ones visible:"
  PYTHONPATH="$PWD:$1" "$PY" - bench/gpu_image_packages.txt "$1" <<'EOF' 2>&1 | grep -v -E "Warning|warn\(|register_constant|^ *$|Error importing huggingface_hub"
import importlib.abc, importlib.metadata as md, os, re, sys
def norm(n): return re.sub(r"[-_.]+", "-", n).lower()
image_list, site = sys.argv[1:3]
allowed = {norm(ln.split("==")[0].strip()) for ln in open(image_list) if ln.strip() and not ln.startswith("#")}
allowed |= {norm(d.metadata["Name"]) for d in md.distributions(path=[site])}
pmap = md.packages_distributions()
REPO = {"common", "pipelines", "data", "bench", "tests"}
hidden = set()
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        dists = pmap.get(top)
        if top not in REPO and dists and not any(norm(d) in allowed for d in dists):
            hidden.add(top)
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)", name=name)
        return None
sys.meta_path.insert(0, Hide())
mods = ["common.config", "common.run", "pipelines.text2image.spec", "pipelines.text2image.train", "data.synth",
        "common.parallel.compile", "common.optim", "common.precision.hardware", "bench.gpu_train_bench",
        "bench.kernels", "torchao.float8", "open_clip", "webdataset"]
for m in mods:
    __import__(m)
    mod = sys.modules[m.split(".")[0]]
    where = "(carried)" if os.path.abspath(getattr(mod, "__file__", "") or "").startswith(os.path.abspath(site)) else ""
    print(f"  ok  {m} {where}")
from common.nn.text_encoder import TextEncoder, TextEncoderConfig
tokens, _ = TextEncoder(TextEncoderConfig(width=32, layers=1, heads=2, context_length=16))(["a red circle"])
print(f"  ok  open_clip text tower + tokenizer (ftfy): {tuple(tokens.shape)}")
print(f"  hidden, not on the image (imports survived them): {sorted(hidden) or 'none'}")
EOF
}

if [ "$MODE" = verify ]; then
  ls "$WHL"/*.whl >/dev/null 2>&1 || { echo "gpu_wheels: no $WHL/*.whl: run bash bench/gpu_wheels.sh first" >&2; exit 1; }
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels_verify.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "dry install for CPython 3.12 manylinux x86_64 into a clean --target ($tmp/site):"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$tmp/site" \
    "${TARGET_ARGS[@]}" "$WHL"/*.whl
  # Each needed package installed exactly once, at the pinned version.
  fail=0
  for spec in "${NEEDED[@]}"; do
    n=$(norm "${spec%%==*}"); v=${spec#*==}
    found=$(cd "$tmp/site" && ls -d *.dist-info 2>/dev/null | while read -r d; do
      dn=${d%.dist-info}; echo "$(norm "${dn%-*}")==${dn##*-}"; done | grep "^$n==" || true)
    if [ "$found" = "$n==$v" ]; then echo "  ok  $spec"; else echo "  BAD $spec: installed '${found:-nothing}'"; fail=1; fi
  done
  extra=$(cd "$tmp/site" && ls -d *.dist-info | wc -l)
  [ "$extra" -eq "${#NEEDED[@]}" ] || { echo "  BAD: $extra distributions installed, ${#NEEDED[@]} needed"; fail=1; }
  for m in omegaconf webdataset braceexpand open_clip ftfy wcwidth torchao; do
    [ -e "$tmp/site/$m" ] || [ -e "$tmp/site/$m.py" ] || { echo "  BAD: module $m missing from the target"; fail=1; }
  done
  check_requirements || fail=1
  import_check "$tmp/site" || fail=1
  report_sizes || fail=1
  [ "$fail" -eq 0 ] && echo "verify: OK (${#NEEDED[@]} wheels install for cp312 manylinux)" || echo "verify: FAILED"
  exit "$fail"
fi

# ---- download -----------------------------------------------------------------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "downloading ${#NEEDED[@]} wheels (cp312, manylinux x86_64 or pure Python, --no-deps) with $PY:"
failed=()
for spec in "${NEEDED[@]}"; do
  if "$PY" -m pip download -q --no-deps "${TARGET_ARGS[@]}" -d "$tmp" "$spec" >"$tmp/pip.log" 2>&1; then
    echo "  got $spec"
  else
    echo "  FAILED $spec: no cp312 manylinux_x86_64 / py3-none-any wheel on the index" >&2
    grep -E "ERROR|No matching" "$tmp/pip.log" | cut -c1-300 | sed "s/^/    /" >&2 || true
    failed+=("$spec")
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "gpu_wheels: ERROR: no usable wheel for: ${failed[*]} (nothing in $WHL/ was changed)" >&2
  exit 1
fi
rm -f "$tmp/pip.log"
# Replace .whl/ as a whole: a stale second version of a package would stop the install there.
rm -rf "$WHL"
mkdir -p "$WHL"
mv "$tmp"/*.whl "$WHL"/
check_requirements
report_sizes
echo "carry with: run(carry=[\".whl\"], command=\"bash bench/gpu_check.sh\")"
