# The two commands of the README, plus the benchmark and fuzzing.
.PHONY: showcase test bench fuzz

showcase:
	./scripts/showcase.sh

test:
	./scripts/test.sh

bench:
	./scripts/bench.sh

# Each fuzz target for FUZZ_SECONDS (default 60) from fuzz/corpus (docs/fuzzing.md).
fuzz:
	./scripts/fuzz.sh
