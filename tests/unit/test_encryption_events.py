"""What a socket monitor's security events say (wire/encryption.py): libzmq reports a frame that
fails CurveZMQ's authentication after the handshake with the same event as a handshake under
another token, so the text depends on whether that connection's handshake had succeeded."""

import zmq

from reduction_server.wire import encryption

_CRYPTOGRAPHIC = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)


def test_a_frame_failing_authentication_after_the_handshake_is_named_an_alteration():
    reason, certain = encryption.handshake_failure(*_CRYPTOGRAPHIC, encrypt=True, secured=True)
    assert reason == encryption.ALTERED and certain
    assert "altered on the way" in reason and "RS_ENCRYPT" in reason


def test_a_failing_handshake_still_names_the_token():
    reason, certain = encryption.handshake_failure(*_CRYPTOGRAPHIC, encrypt=True, secured=False)
    assert "another RS_JOB_TOKEN" in reason and "altered" not in reason and certain


def test_a_side_that_cannot_tell_the_connections_apart_names_both():
    reason, certain = encryption.handshake_failure(*_CRYPTOGRAPHIC, encrypt=True)  # the reducer's monitor
    assert "another RS_JOB_TOKEN" in reason and encryption.ALTERED in reason and certain


def test_other_events_are_no_handshake_failure():
    assert encryption.handshake_failure(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, encrypt=True, secured=True) is None
    assert encryption.handshake_failure(zmq.EVENT_DISCONNECTED, 7, encrypt=True, secured=True) is None
