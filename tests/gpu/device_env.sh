# Source this at the start of a command on the lent GPU machine (see tests/gpu/README.md).
# Installs the carried wheels (.whl), unpacks the prebuilt extension modules (.devcache) and sets paths.
set -e
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  touch /tmp/site/.done
fi
mkdir -p /tmp/prebuilt
for f in .devcache/*.so.gz; do
  [ -f "$f" ] || continue
  out=/tmp/prebuilt/$(basename "$f" .gz)
  [ -f "$out" ] || gunzip -c "$f" > "$out"
done
export PYTHONPATH=/tmp/site:/tmp/prebuilt:$PWD
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
set +e
