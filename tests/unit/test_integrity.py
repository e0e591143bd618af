"""RS_INTEGRITY's pieces (wire/integrity.py, wire/poly1305.py): OpenSSL's Poly1305 gives RFC 8439's
tag, each connection's keys come from the token, its HELLO and the reducer's nonce (the same on
both sides, new with every handshake, one per direction), and a tag frame proves its message's bytes and its place in
the sequence."""

from __future__ import annotations

import numpy as np
import pytest

from reduction_server.errors import ConfigError
from reduction_server.wire import integrity, poly1305
from reduction_server.wire.integrity import TAG_FRAME_BYTES

TOKEN = "integrity-unit-token"
HELLO, REDUCER_NONCE = b'{"nonce": "77"}', b"r" * 32


def test_poly1305_gives_rfc_8439s_tag_over_parts_of_any_buffer_type():
    key = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
    message = b"Cryptographic Forum Research Group"
    expected = bytes.fromhex("a8061dc1305136c6c22b8baf0c0127a9")  # RFC 8439, 2.5.2
    assert poly1305.tag(key, [message]) == expected
    parts = [message[:5], memoryview(message[5:20]), np.frombuffer(message[20:], np.uint8), b""]
    assert poly1305.tag(key, parts) == expected


def test_both_sides_derive_the_same_keys_one_per_direction_and_connection():
    up, down = integrity.channels(TOKEN, HELLO, REDUCER_NONCE)
    again = integrity.channels(TOKEN, HELLO, REDUCER_NONCE)
    assert (up.key, down.key) == (again[0].key, again[1].key)  # what the other side derives
    assert up.key != down.key
    others = [
        integrity.channels(TOKEN, HELLO, b"R" * 32),  # another handshake's reducer nonce
        integrity.channels(TOKEN, b'{"nonce": "78"}', REDUCER_NONCE),  # another HELLO
        integrity.channels("another-token", HELLO, REDUCER_NONCE),
    ]
    assert len({up.key, down.key, *(c.key for pair in others for c in pair)}) == 8


def pair():
    sender, _ = integrity.channels(TOKEN, HELLO, REDUCER_NONCE)
    receiver, _ = integrity.channels(TOKEN, HELLO, REDUCER_NONCE)
    return sender, receiver


def test_a_tagged_message_opens_in_sequence():
    sender, receiver = pair()
    for n in range(3):
        parts = [b"H" * 88, bytes([n]) * 1000]
        tag = sender.seal(parts)
        assert len(tag) == TAG_FRAME_BYTES and int.from_bytes(tag[:8], "little") == n
        assert receiver.open(parts, tag) is None
    assert receiver.seq == 3


@pytest.mark.parametrize("where", [0, 87, 88, 1087])
def test_an_altered_byte_of_header_or_payload_fails_the_check(where):
    sender, receiver = pair()
    message = bytearray(b"H" * 88 + b"P" * 1000)
    tag = sender.seal([bytes(message[:88]), bytes(message[88:])])
    message[where] ^= 0x40
    why = receiver.open([bytes(message[:88]), bytes(message[88:])], tag)
    assert "message #0 failed its integrity check" in why and integrity.ALTERED in why


def test_frames_cannot_be_moved_between_header_and_payload_or_dropped():
    sender, receiver = pair()
    tag = sender.seal([b"H" * 88, b""])
    assert "failed its integrity check" in receiver.open([b"H" * 88], tag)  # the same bytes, one frame fewer


def test_a_replayed_a_dropped_and_an_untagged_message_are_named():
    sender, receiver = pair()
    first = sender.seal([b"a"])
    assert receiver.open([b"a"], first) is None
    assert "(a replay)" in receiver.open([b"a"], first)
    sender.seal([b"b"])  # never delivered
    assert "one was dropped" in receiver.open([b"c"], sender.seal([b"c"]))
    assert "without its 24-byte tag frame" in receiver.open([], b"H" * 88)


def test_a_tag_of_another_direction_or_connection_fails():
    up, down = integrity.channels(TOKEN, HELLO, REDUCER_NONCE)
    _, down_again = integrity.channels(TOKEN, HELLO, REDUCER_NONCE)
    other_up, _ = integrity.channels(TOKEN, HELLO, b"R" * 32)
    assert "failed its integrity check" in down_again.open([b"x"], up.seal([b"x"]))
    _, down_again = integrity.channels(TOKEN, HELLO, REDUCER_NONCE)
    assert "failed its integrity check" in down_again.open([b"x"], other_up.seal([b"x"]))


def test_encryption_makes_tags_redundant_and_tags_need_a_token():
    assert integrity.applies(True, False)
    assert not integrity.applies(True, True) and not integrity.applies(False, False)
    with pytest.raises(ConfigError, match="RS_INTEGRITY=1 needs RS_JOB_TOKEN"):
        integrity.check("")
    integrity.check(TOKEN)


def test_a_mismatch_names_both_settings():
    assert "this reducer requires tags" in integrity.mismatch(True, 3) and "rank 3 does not" in integrity.mismatch(
        True, 3
    )
    assert "rank 3 does;" in integrity.mismatch(False, 3) and "RS_INTEGRITY" in integrity.mismatch(False, 3)


def test_a_workers_options_resolve_the_setting_against_encryption_and_the_token():
    from reduction_server.client.engine.options import EngineOptions

    def resolve(**options):
        return EngineOptions.resolve(["127.0.0.1:1"], 0, 1, **options)

    assert resolve(job_token=TOKEN, integrity=True).integrity
    assert not resolve(job_token=TOKEN, integrity=True, encrypt=True).integrity  # CurveZMQ authenticates already
    assert not resolve(job_token=TOKEN).integrity
    with pytest.raises(ConfigError, match="RS_INTEGRITY=1 needs RS_JOB_TOKEN"):
        resolve(job_token="", integrity=True)
