#!/usr/bin/env bash
# Fuzzing (cargo-fuzz, fuzz/): builds the targets and runs each for FUZZ_SECONDS (default
# 60) from the corpus kept in fuzz/corpus/<target>. A panic, crash, timeout or running
# out of memory fails the run; libFuzzer saves the input under fuzz/artifacts/<target>/
# and cargo-fuzz prints the command that reproduces it.
#
#   make fuzz                           # every target, 60 s each
#   FUZZ_SECONDS=300 make fuzz
#   scripts/fuzz.sh quantity record     # some targets only
#   FUZZ_VERBOSE=1 make fuzz            # with libFuzzer's progress lines
#
# The kept corpus is only read: libFuzzer writes what it finds into the first corpus
# directory it is given, which here is a temporary copy, so a run changes no tracked
# file (fuzz/artifacts is ignored). FUZZ_CORPUS_OUT=DIR keeps those copies (DIR/<target>), to merge the useful
# ones into fuzz/corpus with `cargo +"$SG_NIGHTLY" fuzz cmin` (docs/fuzzing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_build_deps
ensure_fuzz_toolchain

seconds="${FUZZ_SECONDS:-60}"
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "FUZZ_SECONDS=$seconds is not a positive number of seconds" >&2
  exit 1
fi
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# cargo-fuzz has no --locked; this fails, as --locked would, when fuzz/Cargo.lock is stale.
cargo +"$SG_NIGHTLY" metadata --manifest-path fuzz/Cargo.toml --locked --format-version 1 >/dev/null

if (($#)); then
  targets=("$@")
else
  mapfile -t targets < <(cargo +"$SG_NIGHTLY" fuzz list)
fi

echo "==> cargo fuzz build (${targets[*]})"
start=$SECONDS
cargo +"$SG_NIGHTLY" fuzz build
echo "    built in $((SECONDS - start)) s"

work=$(mktemp -d /tmp/shareguard-fuzz.XXXXXX)
trap 'rm -rf "$work"' EXIT
failed=()
summary=()
for t in "${targets[@]}"; do
  if [ ! -d "fuzz/corpus/$t" ]; then
    echo "fuzz/corpus/$t is missing: every target keeps a seed corpus" >&2
    exit 1
  fi
  corpus="$work/$t"
  mkdir -p "$corpus"
  cp -R "fuzz/corpus/$t/." "$corpus/"
  args=(-max_total_time="$seconds" -timeout=10 -print_final_stats=1)
  # libFuzzer prints a line per new input found, thousands a minute; failures are
  # reported in full either way. FUZZ_VERBOSE=1 shows that progress.
  [ "${FUZZ_VERBOSE:-0}" = 1 ] || args+=(-verbosity=0 -print_funcs=0)
  # Tokens of the input's grammar (suffixes, config keys) that mutation alone finds slowly.
  [ -f "fuzz/dict/$t.dict" ] && args+=(-dict="$PWD/fuzz/dict/$t.dict")
  echo "==> fuzz $t (${seconds} s, from fuzz/corpus/$t)"
  log="$work/$t.log"
  status=0
  cargo +"$SG_NIGHTLY" fuzz run "$t" "$corpus" "fuzz/corpus/$t" -- "${args[@]}" 2>&1 | tee "$log" ||
    status=${PIPESTATUS[0]}
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if ((status)); then
    failed+=("$t")
    summary+=("$(printf '%-15s FAILED after %s runs (input in fuzz/artifacts/%s/)' "$t" "${execs:-?}" "$t")")
  else
    summary+=("$(printf '%-15s ok, %s runs' "$t" "${execs:-?}")")
  fi
  if [ -n "${FUZZ_CORPUS_OUT:-}" ]; then
    mkdir -p "$FUZZ_CORPUS_OUT/$t"
    cp -R "$corpus/." "$FUZZ_CORPUS_OUT/$t/"
  fi
done

echo "==> fuzz summary (${seconds} s per target)"
printf '    %s\n' "${summary[@]}"
du -sh fuzz/target 2>/dev/null || true
if ((${#failed[@]})); then
  echo "fuzzing found a failure in: ${failed[*]}; fix it, add a regression test with the" >&2
  echo "input inline, and add the input to fuzz/corpus/<target>/ (docs/fuzzing.md)" >&2
  exit 1
fi
