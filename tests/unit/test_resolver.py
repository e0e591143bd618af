"""A lost reducer's name is looked up off the engine's and libzmq's threads (client/engine/resolver.py)."""

import time

import pytest

from reduction_server.client.engine.resolver import Resolver


def answer(resolver: Resolver, endpoint: str, limit: float = 10.0):
    """Ask until the lookup is done (None meanwhile, never blocking)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        started = time.monotonic()
        address = resolver.address(endpoint)
        assert time.monotonic() - started < 0.5  # it never waits for the lookup
        if address is not None:
            return address
        time.sleep(0.01)
    raise AssertionError(f"{endpoint} was not looked up within {limit} s")


def test_a_literal_address_is_used_as_it_is():
    resolver = Resolver()
    assert resolver.address("127.0.0.1:5555") == "127.0.0.1:5555"
    assert resolver.address("[::1]:5555") == "[::1]:5555"
    resolver.close()


def test_a_name_is_looked_up_on_another_thread_and_again_for_each_connection():
    resolver = Resolver()
    assert resolver.address("localhost:5555") is None  # the lookup started; nothing waited for it
    assert answer(resolver, "localhost:5555") in ("127.0.0.1:5555", "[::1]:5555")
    assert resolver.address("localhost:5555") is None  # the next connection looks it up again
    resolver.close()


def test_a_name_that_does_not_resolve_is_an_oserror_once_looked_up():
    resolver = Resolver()
    with pytest.raises(OSError):
        answer(resolver, "no-such-reducer.invalid:5555")
    assert resolver.address("no-such-reducer.invalid:5555") is None  # asked again: a new lookup
    resolver.close()
