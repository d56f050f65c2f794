# Source this at the start of a command on the lent GPU machine (see tests/gpu/README.md).
# Installs the carried wheels (.whl*/, each wheel once per machine, so later calls may carry more),
# unpacks the prebuilt extension modules (.devcache*/) and sets paths.
set -e
mkdir -p /tmp/site/.installed /tmp/prebuilt
new=()
for w in .whl*/*.whl; do
  [ -f "$w" ] && [ ! -f "/tmp/site/.installed/$(basename "$w")" ] && new+=("$w")
done
if [ ${#new[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${new[@]}"
  for w in "${new[@]}"; do touch "/tmp/site/.installed/$(basename "$w")"; done
fi
for f in .devcache*/*.so.gz; do
  [ -f "$f" ] || continue
  out=/tmp/prebuilt/$(basename "$f" .gz)
  [ -f "$out" ] || gunzip -c "$f" > "$out"
done
export PYTHONPATH=/tmp/site:/tmp/prebuilt:$PWD
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
set +e
