#!/usr/bin/env bash
# Makes a SIMULATED NVIDIA driver root for machines without a GPU: what the agent's
# driver discovery looks for (limiter-gpu/src/driver.rs), laid out as a Debian host's.
#
#   dev/nvidiactl, dev/nvidia-uvm, dev/nvidia-uvm-tools, dev/nvidia0..N-1
#       character devices made with mknod (NVIDIA's major 195 for the GPUs and the
#       control node), never opened: no driver is behind them
#   usr/lib/<multiarch>/libcuda.so.<version> (+ libcuda.so.1, libcuda.so)
#   usr/lib/<multiarch>/libnvidia-ml.so.<version> (+ libnvidia-ml.so.1)
#       real shared objects built from simulated-driver/*.c, with the sonames of
#       NVIDIA's, so the dynamic linker in a container finds them as it would the driver's
#   usr/bin/nvidia-smi
#       a shell script that lists the GPU nodes the container has
#
# With PROBE, also builds simulated-driver/cuda-probe.c there: a program linked
# against libcuda.so.1, which runs only where the linker finds one.
#
# Usage (as root: mknod): simulated-driver-root.sh ROOT GPUS [VERSION] [PROBE]
# Idempotent: an existing root is brought up to date.
set -euo pipefail
root="$1"
gpus="$2"
version="${3:-550.54.15}"
probe="${4:-}"
src="$(cd "$(dirname "$0")/simulated-driver" && pwd)"
lib="$root/usr/lib/$(gcc -print-multiarch)"
mkdir -p "$root/dev" "$lib" "$root/usr/bin"

node() {
  local path="$root/dev/$1"
  if [ -e "$path" ] && [ "$(stat -c '%F %t %T' "$path")" != "character special file $(printf '%x %x' "$2" "$3")" ]; then
    rm -f "$path"
  fi
  [ -e "$path" ] || mknod -m 0666 "$path" c "$2" "$3"
}
node nvidiactl 195 255
# nvidia-uvm's major is given out by the kernel at load time; any free one will do.
node nvidia-uvm 511 0
node nvidia-uvm-tools 511 1
for ((i = 0; i < gpus; i++)); do
  node "nvidia$i" 195 "$i"
done

# so NAME SONAME SOURCE: a shared object of the driver's version and its ldconfig links.
so() {
  gcc -shared -fPIC -O2 -Wl,-soname,"$2" -o "$lib/$1.so.$version" "$3"
  ln -sfn "$1.so.$version" "$lib/$2"
  ln -sfn "$2" "$lib/$1.so"
}
so libcuda libcuda.so.1 "$src/libcuda.c"
so libnvidia-ml libnvidia-ml.so.1 "$src/libnvidia-ml.c"
install -m 0755 "$src/nvidia-smi" "$root/usr/bin/nvidia-smi"

if [ -n "$probe" ]; then
  gcc -O2 -o "$probe" "$src/cuda-probe.c" -L"$lib" -l:libcuda.so.1
fi
