"""The in-process server of tests/integration (its `SERVER_OPTIONS` convention) for the
reliability tests that use one."""

from tests.integration.conftest import channel, server  # noqa: F401  (pytest fixtures)
