# Conveniences over scripts/; CI runs .ci/run. Each target uses .venv (made on first use),
# not the system Python, which lacks grpcio-tools.
.PHONY: test test-vllm test-engine test-sglang test-lmcache proto proto-check
test:
	scripts/test -q
test-vllm:
	scripts/test-vllm -q
test-engine:
	scripts/test-engine -q
test-sglang:
	scripts/test-sglang -q
test-lmcache:
	scripts/test-lmcache -q
proto:
	scripts/venv-run python scripts/gen_protos.py
proto-check:
	scripts/venv-run python scripts/gen_protos.py --check
