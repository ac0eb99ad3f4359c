# The two commands of the README, plus the benchmark.
.PHONY: showcase test bench

showcase:
	./scripts/showcase.sh

test:
	./scripts/test.sh

bench:
	./scripts/bench.sh
