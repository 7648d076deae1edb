# Conveniences over scripts/; CI runs .ci/run.
.PHONY: test test-vllm proto proto-check
test:
	scripts/test -q
test-vllm:
	scripts/test-vllm -q
proto:
	python3 scripts/gen_protos.py
proto-check:
	python3 scripts/gen_protos.py --check
