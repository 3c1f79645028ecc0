"""The deploy tests run against the same server subprocess as the e2e tier."""

from tests.e2e.conftest import make_server, server  # noqa: F401  (fixtures)
