# Conveniences over scripts/; CI runs .ci/run.
.PHONY: test test-vllm test-sglang proto proto-check
test:
	scripts/test -q
test-vllm:
	scripts/test-vllm -q
test-sglang:
	scripts/test-sglang -q
proto:
	python3 scripts/gen_protos.py
proto-check:
	python3 scripts/gen_protos.py --check
