#!/usr/bin/env bash
# The checks that need a machine this one is not: a GPU (the CUDA tensor path) and many cores
# (a reducer host's scaling), run in one go on a lent device machine, which reaches no network.
#
#   bench/device.sh pack   here: wheels for the device's Python into .device/ (git ignores it)
#   bench/device.sh run [STEP...]
#                          there, from the repository root, with .device carried: installs the
#                          wheels, runs the CUDA tests and the scaling suites (or only the STEPs
#                          named: cuda-tests, bench-reducer, bench-reducer-int8, bench-reducer-encrypt,
#                          bench-chunks, bench-kernels, bench-loopback, bench-netem-int8,
#                          bench-ddp-int8, bench-failover, bench-netem-16, bench-sizing-1,
#                          bench-sizing-2), and leaves each log and table under $OUT (bench/out/device
#                          here when OUT is unset); name the steps: all of them exceed one call's 10 minutes
#
# The device's image holds Python, torch, numpy, pytest and psutil but not pyzmq: `pack` builds
# this project's wheel for that Python (DEVICE_PYTHON, a 3.12 interpreter by default, as the
# image's is) and fetches pyzmq's and cloudpickle's. `run` builds the project there instead when the wheel does not
# fit that Python. The image has no iproute2 either, which the emulated network needs: `pack`
# copies this machine's ip and tc with their libraries (built against an older glibc than the
# device's), each run through the device's own loader with only those libraries added. Each step of `run` is bounded in time and reports its exit status; the run
# goes on past a failed step, so that one call brings back everything that worked.
set -uo pipefail
cd "$(dirname "$0")/.."
KIT=.device
PYZMQ=${PYZMQ:-pyzmq==27.3.0}
CLOUDPICKLE=${CLOUDPICKLE:-cloudpickle==3.1.3}

pack() {
  set -e
  local python=${DEVICE_PYTHON:-python3.12}
  local version
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  rm -rf "$KIT" && mkdir -p "$KIT/wheels"
  # Built from a copy of what git would commit: a build/ folder here may hold modules since removed.
  local tree
  tree=$(mktemp -d)
  trap "rm -rf '$tree'" EXIT
  git ls-files -z --cached --others --exclude-standard \
    | tar -c --null --ignore-failed-read -T - | tar -x -C "$tree"  # a file deleted but not staged: left out
  "$python" -m pip wheel -q --no-deps -w "$KIT/wheels" "$tree"
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$KIT/wheels" "$PYZMQ" "$CLOUDPICKLE"
  pack_iproute2
  du -sh "$KIT" && ls "$KIT/wheels"
}

pack_iproute2() {  # $KIT/iproute2/bin/{ip,tc}: wrappers that run the copies with their libraries
  local kit=$KIT/iproute2 tool
  mkdir -p "$kit/bin" "$kit/real" "$kit/lib"
  for tool in ip tc; do
    cp "$(command -v "$tool")" "$kit/real/"
    ldd "$kit/real/$tool" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' \
      | grep -v -E '/(libc|libm|libpthread|libdl|ld-linux[^/]*)\.so' | xargs -r cp -L -t "$kit/lib"
    # the loader's --library-path holds for this process only: what `ip netns exec` starts runs
    # with the device's own libraries
    printf '#!/bin/sh\nkit=$(dirname "$(dirname "$(readlink -f "$0")")")\nexec /lib64/ld-linux-x86-64.so.2 --library-path "$kit/lib" "$kit/real/%s" "$@"\n' \
      "$tool" > "$kit/bin/$tool"
    chmod +x "$kit/bin/$tool"
  done
}

STEPS=()
step() {  # step NAME SECONDS COMMAND...: run it, its output to $OUT/NAME.log, and say how it ended
  local name=$1 seconds=$2
  shift 2
  if [ ${#STEPS[@]} -gt 0 ] && [[ " ${STEPS[*]} " != *" $name "* ]]; then return; fi
  echo "== $name (at most ${seconds} s)"
  timeout -k 10 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc"
}

run() {
  OUT=${OUT:-bench/out/device}
  OUT=$(realpath -m "$OUT") && mkdir -p "$OUT" "$OUT/int8" "$OUT/encrypt" "$OUT/netem16" "$OUT/sizing1" "$OUT/sizing2"
  local site=/tmp/rs-site
  export PYTHONUNBUFFERED=1
  python3 -V && nproc && (nvidia-smi -L || true)
  rm -rf "$site"
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$KIT"/wheels/*.whl; then
    echo "the packed wheels do not fit $(python3 -V 2>&1): building this project here"
    rm -rf "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$KIT"/wheels/pyzmq-*.whl \
      "$KIT"/wheels/cloudpickle-*.whl &&
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . ||
      { echo "could not install reduction-server on $(python3 -V 2>&1)"; return 1; }
  fi
  export PYTHONPATH=$site PATH=$site/bin:$PATH
  if ! command -v ip > /dev/null && [ -x "$KIT/iproute2/bin/ip" ]; then
    PATH=$(realpath "$KIT/iproute2/bin"):$PATH
  fi
  env -C "$OUT" python3 -c 'import reduction_server, zmq, torch; print("reduction_server", reduction_server.__version__,
    "from", reduction_server.__file__, "pyzmq", zmq.__version__, "torch", torch.__version__,
    "cuda", torch.cuda.is_available())'
  # The CUDA tensor path: the torch and Horovod adapters' jobs with every tensor on the GPU.
  step cuda-tests 200 python3 -m pytest -q -rs -p no:cacheprovider -k cuda \
    tests/jobs/test_torch_backend.py tests/jobs/test_horovod_torch.py tests/jobs/test_communicator_lifetime.py
  # A reducer host's cores: CPU per GiB and throughput against shards, and the loopback row; run
  # away from the source tree, which holds an uncompiled reduction_server.
  step bench-reducer 150 env -C "$OUT" python3 -m reduction_server bench reducer --workers 4,8 --shards 1,4,8,16 \
    --out "$OUT"
  # int8 blocks against float32 in the reducer, as issue 41 counts it (per GiB of float32)
  step bench-reducer-int8 150 env -C "$OUT/int8" python3 -m reduction_server bench reducer --workers 4 --shards 1,4 \
    --compression none,int8 --out "$OUT/int8"
  # RS_INTEGRITY's and RS_ENCRYPT's price on both sides, in turns with the defaults (issue 37)
  step bench-reducer-encrypt 200 env -C "$OUT/encrypt" python3 -m reduction_server bench reducer --workers 4 \
    --shards 1 --variant RS_INTEGRITY=1 --variant RS_ENCRYPT=1 --out "$OUT/encrypt"
  step bench-chunks 300 env -C "$OUT" python3 -m reduction_server bench chunks --rounds 3 --out "$OUT"
  step bench-kernels 60 env -C "$OUT" python3 -m reduction_server bench kernels --out "$OUT"
  step bench-loopback 120 env -C "$OUT" python3 -m reduction_server bench loopback --workers 4 --reducers 2 --mib 64 \
    --rounds 3 --out "$OUT"
  # issue 41's emulated-network rows: int8 (and bf16) against float32 and Gloo in the same turns
  step bench-netem-int8 240 env -C "$OUT/int8" python3 -m reduction_server bench netem --workers 8 --reducers 4 \
    --rate-mbit 200 --reducer-rate-mbit 400 --mib 16 --compression none,int8,bf16 --rounds 5 --out "$OUT/int8"
  step bench-ddp-int8 240 env -C "$OUT/int8" python3 -m reduction_server bench ddp --workers 4 --compression int8 \
    --rounds 2 --out "$OUT/int8"
  # issue 39's drain against a SIGKILL, on the emulated network
  step bench-failover 200 env -C "$OUT" python3 -m reduction_server bench failover --workers 4 --reducers 3 \
    --rate-mbit 400 --mib 4 --rounds 3 --out "$OUT"
  # issue 40's largest emulated job: W=16 R=16 at 100 Mbit/s beside Gloo's ring
  step bench-netem-16 400 env -C "$OUT/netem16" python3 -m reduction_server bench netem --workers 16 --reducers 16 \
    --rate-mbit 100 --mib 16 --rounds 3 --out "$OUT/netem16"
  # issue 42's validation grid, a half per call (the round-trip points need the kernel's netem delay; the
  # suite says so per point where it has none)
  step bench-sizing-1 540 env -C "$OUT/sizing1" python3 -m reduction_server bench sizing --part 1/2 --out "$OUT/sizing1"
  step bench-sizing-2 540 env -C "$OUT/sizing2" python3 -m reduction_server bench sizing --part 2/2 --out "$OUT/sizing2"
}

case "${1:-}" in
  pack) pack ;;
  run) STEPS=("${@:2}") && run ;;
  *) echo "usage: bench/device.sh pack|run" >&2; exit 2 ;;
esac
