"""Real server processes for tests and benchmarks (installed as kvstore_testing): a
kvstore-server on a free loopback port, and a Valkey/Redis cluster for the far tier."""
