"""Which packages the kvstore distribution installs, found from its folders.

Each import name below comes from one folder of this repository, and every package beneath
that folder (every directory with an __init__.py) is found, not listed: a list written by
hand once missed kvstore_server.far, kvstore_server.fastpath and kvstore_connector.transfer,
so a wheel (`pip install .`, the container image) lacked them and kvstore-server died at
import, while the editable installs the tests used worked. tests/deploy/test_wheel.py
builds the wheel, checks that it holds every package folder and runs the server from it.
Everything else about the distribution is in pyproject.toml.
"""

from setuptools import find_packages, setup

# import name -> the folder it is installed from
ROOTS = {
    "kvstore_server": "kvstore_server",
    "kvstore_client": "kvstore_client",
    # What server and client agree on (the generated protobuf code among it); both import it.
    "kvstore_protocol": "kvstore_protocol",
    # The connector/ folder, installed under our own name (connector is a name others use).
    "kvstore_connector": "connector",
    "kvstore_bench": "bench",
    # Server and cluster processes that tests and benchmarks start.
    "kvstore_testing": "testing",
    # A deprecated alias for one release: connector.vllm and connector.sglang warn and
    # re-export kvstore_connector's (compat/connector/__init__.py says more).
    "connector": "compat/connector",
}

setup(
    packages=[f"{name}.{sub}" if sub else name
              for name, folder in ROOTS.items()
              for sub in ["", *find_packages(folder)]],
    package_dir=ROOTS,
    # The generated protobuf stubs (.pyi) beside their modules, for type checkers.
    package_data={"kvstore_protocol._proto": ["**/*.pyi"]},
)
