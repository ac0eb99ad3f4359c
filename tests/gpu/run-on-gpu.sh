#!/usr/bin/env bash
# The GPU memory limiter on a machine with an NVIDIA GPU: the real NVML probe, a share
# prepared for a test cgroup laid out like a kubelet pod, a CUDA process in that cgroup
# allocating past the share, and what each mechanism did (blocked by the driver, by MPS,
# or caught by the watchdog) with the limit read back. The work is done by the example
# limiter-gpu/examples/gpu_check/main.rs; this script builds it, finds a CUDA allocator and
# prints the context around it.
#
# MPS: where the limiter chooses it (no nvml-cgroup, /usr/bin/nvidia-cuda-mps-control
# installed, MIG off, compute mode DEFAULT), gpu_check starts one MPS control daemon for
# its test share under /run/sg-gpu-check-mps, reads its limit back, runs the allocator
# as its client (CUDA_MPS_PIPE_DIRECTORY, and the daemon's /dev/shm in a mount namespace
# of its own, as the CDI spec gives a container) and stops it when the share is released. A
# gpu_check killed from outside (the timeout below) can leave that daemon; the EXIT
# trap quits it (and the next run would stop it too).
#
# Issue 24 (items 2 and 8): gpu_check also prints one `CHECK <name>: PASS|FAIL|NOT-RUN`
# line per fixed point (the getter on a cgroup never limited, a cleared limit read back
# as none and which "no limit" value the driver took, a limit below current usage, NVML
# reopened after a simulated loss, the limiter built when NVML comes late, the agent's
# gpus = "all" list being every GPU NVML lists); they are
# repeated together at the end.
#
# Usage (as root, from anywhere in the repository):
#   tests/gpu/run-on-gpu.sh
# Optional environment:
#   GPU_CHECK_GPU=<index|uuid>        GPU to test (default 0)
#   GPU_CHECK_SHARE_MIB=<n>           share size (default 1024)
#   GPU_CHECK_ALLOC_MIB=<n>           what the allocator asks for (default 2048)
#   GPU_CHECK_WATCHDOG_ACTION=terminate|report   (default terminate)
#   GPU_CHECK_ALLOCATOR=torch|cuda-driver|none   force an allocator (default: detect)
#   GPU_CHECK_BIN=<path>              use this gpu_check binary instead of building one
#
# Nothing is downloaded: the build uses the crates already in ~/.cargo (it tries once
# with the network only if that fails), and the allocator is PyTorch if it is installed,
# else python3 + ctypes calling cuMemAlloc in libcuda.so.1, which ships with the driver.
#
# Exit status: 0 when the check ran, whatever it found (including "no GPU here" and
# "not supported"); non-zero only when the script itself failed (no cargo, build failed,
# the allocator could not run, or cleanup left a limit, cgroup or MPS daemon behind).
#
# Time: about 1-2 minutes, at most about 5. The cargo build dominates: a release build of
# shareguard-limiter-gpu and its dependencies only (about a minute on 16 cores, bounded
# below); torch's import and the allocator's 10 s hold come next.

set -euo pipefail

say() { printf '%s\n' "$*"; }
section() { printf '\n== %s ==\n' "$*"; }

# One deadline for the whole run; every slow step gets what is left of it.
deadline=$((SECONDS + 290))
left() {
    local l=$((deadline - SECONDS))
    if ((l < 10)); then l=10; fi
    echo "$l"
}

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
if [[ ! -f Cargo.toml || ! -d limiter-gpu ]]; then
    say "run-on-gpu.sh: $repo does not look like the shareguard repository"
    exit 1
fi

tmp=$(mktemp -d)
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
    rm -rf "$tmp"
    # gpu_check removes its own cgroup, even when it panics; this only catches one
    # left by a gpu_check killed from outside (Ctrl-C). Its GPU limit goes with it.
    local top dir
    for top in /sys/fs/cgroup/shareguard-gpu-check-* /sys/fs/cgroup/unified/shareguard-gpu-check-*; do
        [[ -d $top ]] || continue
        say "cleanup: removing leftover test cgroup $top"
        if [[ -e $top/cgroup.kill ]]; then echo 1 >"$top/cgroup.kill" 2>/dev/null || true; fi
        sleep 0.5
        while IFS= read -r dir; do
            rmdir "$dir" 2>/dev/null || say "cleanup: could not remove $dir"
        done < <(find "$top" -depth -type d 2>/dev/null)
    done
    # An MPS daemon of a gpu_check killed from outside: quit it through its own pipe.
    local pipe
    for pipe in /run/sg-gpu-check-mps/*/pipe; do
        [[ -e $pipe/nvidia-cuda-mps-control.pid ]] || continue
        say "cleanup: quitting leftover MPS daemon in $pipe"
        echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 10 nvidia-cuda-mps-control \
            || say "cleanup: could not quit the daemon in $pipe"
    done
    # Each share's /dev/shm is a tmpfs of its own: detached first, or rm -rf would fail
    # on its mount point.
    local shm
    for shm in /run/sg-gpu-check-mps/*/shm; do
        mountpoint -q "$shm" 2>/dev/null || continue
        umount --lazy "$shm" || say "cleanup: could not detach $shm"
    done
    rm -rf /run/sg-gpu-check-mps
}
trap cleanup EXIT

section "machine"
say "host: $(uname -n), kernel $(uname -r), $(nproc) cores"
say "user: $(id -un) (uid $(id -u))"
if [[ $(id -u) -ne 0 ]]; then
    say "NOTE: not root; creating the test cgroup and setting NVML limits need root, expect 'permission denied' below"
fi

# --- Is there an NVIDIA GPU at all? ---------------------------------------------------
nvml_lib=""
if command -v ldconfig >/dev/null 2>&1; then
    nvml_lib=$(ldconfig -p 2>/dev/null | awk '/libnvidia-ml\.so\.1 / && !f { print $NF; f = 1 }' || true)
fi
if [[ -z $nvml_lib ]]; then
    for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib \
        /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/wsl/lib; do
        if [[ -e $d/libnvidia-ml.so.1 ]]; then
            nvml_lib=$d/libnvidia-ml.so.1
            break
        fi
    done
fi
have_dev=no
[[ -e /dev/nvidiactl || -e /dev/nvidia0 ]] && have_dev=yes
say "NVML library: ${nvml_lib:-not found}"
say "NVIDIA device nodes (/dev/nvidiactl, /dev/nvidia0): $have_dev"
if [[ -z $nvml_lib && $have_dev == no ]]; then
    say ""
    say "no NVIDIA GPU / NVML on this machine (no libnvidia-ml.so.1, no /dev/nvidia*): nothing to check."
    exit 0
fi

# --- Context from nvidia-smi ------------------------------------------------------------
section "nvidia-smi"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 30 nvidia-smi || say "nvidia-smi failed (exit $?)"
    timeout 30 nvidia-smi \
        --query-gpu=index,uuid,name,driver_version,memory.total,memory.used,mig.mode.current,compute_mode \
        --format=csv || say "nvidia-smi --query-gpu failed (exit $?)"
else
    say "nvidia-smi: not installed (continuing; the check talks to NVML directly)"
fi
if [[ -r /sys/fs/cgroup/cgroup.controllers ]]; then
    say "cgroup v2 root controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"
elif [[ -r /sys/fs/cgroup/unified/cgroup.controllers ]]; then
    say "cgroup v1 + unified v2; v2 controllers: $(cat /sys/fs/cgroup/unified/cgroup.controllers)"
else
    say "no cgroup v2 hierarchy found under /sys/fs/cgroup"
fi

# --- Build ----------------------------------------------------------------------------
section "build"
if [[ -n ${GPU_CHECK_BIN:-} ]]; then
    bin=$GPU_CHECK_BIN
    say "using GPU_CHECK_BIN=$bin (no build)"
    [[ -x $bin ]] || { say "GPU_CHECK_BIN=$bin is not an executable file"; exit 1; }
else
    if ! command -v cargo >/dev/null 2>&1; then
        say "cargo not found: this script builds limiter-gpu's gpu_check example and needs Rust (1.95) installed here"
        exit 1
    fi
    say "$(cargo --version)"
    # This build is most of the script's run time: release, limiter-gpu and its
    # dependencies only. Offline first, since nothing may be downloadable here.
    build=(cargo build --release --locked -p shareguard-limiter-gpu --example gpu_check)
    start=$SECONDS
    if ! timeout $(($(left) - 60)) "${build[@]}" --offline; then
        say "offline build failed; trying once more with network access (fails fast without it)"
        CARGO_NET_RETRY=0 CARGO_HTTP_TIMEOUT=15 timeout $(($(left) - 60)) "${build[@]}" || {
            say "cargo build failed: see above (missing crates in ~/.cargo and no network?)"
            exit 1
        }
    fi
    say "build took $((SECONDS - start)) s"
    bin=${CARGO_TARGET_DIR:-target}/release/examples/gpu_check
fi

# --- Which CUDA allocator? ------------------------------------------------------------
section "CUDA allocator"
choice=${GPU_CHECK_ALLOCATOR:-detect}
allocator=none
allocator_name=""
if ! command -v python3 >/dev/null 2>&1; then
    say "python3: not found, so neither PyTorch nor the ctypes fallback can run"
else
    say "python3: $(python3 --version 2>&1) at $(command -v python3)"
    if [[ $choice == detect || $choice == torch ]]; then
        # torch's import alone can take 10-20 s on a cold cache.
        if torch_info=$(timeout 60 python3 -c \
            'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1); then
            read -r tv tcuda tavail <<<"$(tail -n 1 <<<"$torch_info")"
            if [[ $tavail == True ]]; then
                allocator=torch
                allocator_name="PyTorch $tv (CUDA $tcuda)"
                say "torch: installed, version $tv, built for CUDA $tcuda, torch.cuda.is_available() = True"
            else
                say "torch: installed (version $tv, CUDA $tcuda) but torch.cuda.is_available() = $tavail: not usable"
            fi
        else
            say "torch: NOT available (import torch failed: $(tail -n 1 <<<"$torch_info"))"
        fi
    fi
    if [[ $allocator == none && ($choice == detect || $choice == cuda-driver) ]]; then
        if out=$(timeout 30 python3 -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>&1); then
            allocator=cuda-driver
            allocator_name="CUDA driver API via python3 ctypes (libcuda.so.1, cuMemAlloc_v2)"
            say "falling back to the CUDA driver API: python3 + ctypes + libcuda.so.1 (cuMemAlloc_v2), no PyTorch needed"
        else
            say "libcuda.so.1: cannot be loaded from python3 ($(tail -n 1 <<<"$out"))"
        fi
    fi
fi
if [[ $choice == none ]]; then
    allocator=none
fi
if [[ $allocator == none ]]; then
    say "allocator: NONE; the probe and the limit still run, nothing allocates"
else
    say "allocator: $allocator_name"
fi

# The allocator: asks for GPU_CHECK_TARGET_BYTES in GPU_CHECK_STEP_BYTES steps, holds
# what it got for GPU_CHECK_HOLD_SECONDS, and reports in the "ALLOC ..." lines that
# gpu_check parses (see the example's documentation).
# Readable by every uid: one check runs it as uid 65534, as a non-root tenant's container.
chmod 755 "$tmp"
cat >"$tmp/alloc.py" <<'PY'
import os
import sys
import time

mode = sys.argv[1]
target = int(os.environ["GPU_CHECK_TARGET_BYTES"])
step = int(os.environ["GPU_CHECK_STEP_BYTES"])
hold = float(os.environ["GPU_CHECK_HOLD_SECONDS"])


def say(msg):
    print("ALLOC " + msg, flush=True)


def one_line(e):
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def torch_setup():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    torch.cuda.init()
    dev = torch.device("cuda", 0)
    torch.empty(1, device=dev)  # creates the context
    say("start via=torch-%s cuda=%s device=%s"
        % (torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)))

    def alloc(n):
        t = torch.ones(n, dtype=torch.uint8, device=dev)  # written, so backed
        torch.cuda.synchronize()
        return t

    return alloc


def cuda_driver_setup():
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(rc, what):
        if rc != 0:
            name = ctypes.c_char_p()
            cu.cuGetErrorName(rc, ctypes.byref(name))
            label = name.value.decode() if name.value else "?"
            raise RuntimeError("%s failed: %s (%d)" % (what, label, rc))

    cu.cuInit.argtypes = [ctypes.c_uint]
    check(cu.cuInit(0), "cuInit")
    version = ctypes.c_int()
    check(cu.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    name = ctypes.create_string_buffer(256)
    cu.cuDeviceGetName.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    check(cu.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
    ctx = ctypes.c_void_p()
    cu.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    say("start via=cuda-driver-api(ctypes,libcuda.so.1,cuMemAlloc_v2) driver_api=%d device=%s"
        % (version.value, name.value.decode()))
    cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    cu.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]

    def alloc(n):
        ptr = ctypes.c_uint64()
        check(cu.cuMemAlloc_v2(ctypes.byref(ptr), n), "cuMemAlloc_v2(%d)" % n)
        check(cu.cuMemsetD8_v2(ptr.value, 1, n), "cuMemsetD8_v2")  # written, so backed
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        return ptr

    return alloc


try:
    alloc = torch_setup() if mode == "torch" else cuda_driver_setup()
except Exception as e:  # noqa: BLE001 - any failure here is the finding
    say("init-failed error=" + one_line(e))
    sys.exit(3)

held = []
total = 0
while total < target:
    n = min(step, target - total)
    try:
        held.append(alloc(n))
    except Exception as e:  # noqa: BLE001
        say("fail total=%d step=%d error=%s" % (total, n, one_line(e)))
        break
    total += n
    say("ok total=%d" % total)
say("holding total=%d seconds=%g" % (total, hold))
time.sleep(hold)
say("done total=%d" % total)
PY

# --- The check ------------------------------------------------------------------------
section "gpu_check"
# gpu_check kills its allocator at --timeout-secs and cleans up; the outer timeout is
# only a backstop (a killed gpu_check leaves its cgroup to the trap above).
budget=$(left)
args=(
    --timeout-secs $((budget > 40 ? budget - 30 : 10))
    --gpu "${GPU_CHECK_GPU:-0}"
    --share-mib "${GPU_CHECK_SHARE_MIB:-1024}"
    --alloc-mib "${GPU_CHECK_ALLOC_MIB:-2048}"
    --watchdog-action "${GPU_CHECK_WATCHDOG_ACTION:-terminate}"
)
if [[ $allocator != none ]]; then
    args+=(--allocator-name "$allocator_name" -- python3 -u "$tmp/alloc.py" "$allocator")
fi
say "running: $bin ${args[*]}"
rc=0
timeout "$budget" "$bin" "${args[@]}" | tee "$tmp/gpu_check.out" || rc=$?
# One line per point fixed for issue 24 (nvml-cgroup clear/get/usage, NVML reopened),
# gathered so that this run proves or disproves each at a glance.
section "issue 24 checks"
grep '^CHECK ' "$tmp/gpu_check.out" || say "no CHECK lines: gpu_check ended before its checks"
case $rc in
    0) say "" ; say "run-on-gpu.sh: done in $SECONDS s" ;;
    124) say "run-on-gpu.sh: gpu_check did not finish within $budget s; killed" ;;
    *) say "run-on-gpu.sh: gpu_check failed (exit $rc)" ;;
esac
exit "$rc"
