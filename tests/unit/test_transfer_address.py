"""The one typed address every wormhole sender and receiver uses: it survives the wire (msgpack
commands, the JSON join environment) unchanged, keeps its token out of logs, and refuses anything
that is not an address with a reason a user can act on."""

from __future__ import annotations

import json
import secrets

import msgpack
import pytest

from torchpass_common.errors import ProtocolError
from torchpass_common.transfer_address import TransferAddress


def test_an_address_survives_msgpack_and_json_unchanged() -> None:
    addr = TransferAddress("10.0.0.5", 29500, secrets.token_bytes(32))
    over_mqtt = msgpack.unpackb(msgpack.packb({"dest": addr.wire()}), raw=False)["dest"]
    over_env = json.loads(json.dumps(addr.wire()))
    assert TransferAddress.parse(over_mqtt, "dest") == addr == TransferAddress.parse(over_env, "source")


def test_the_token_never_shows_in_its_text() -> None:
    token = secrets.token_bytes(32)
    addr = TransferAddress("n5", 7001, token)
    assert token.hex() not in repr(addr) and token.hex() not in str(addr) and "n5:7001" in repr(addr)


@pytest.mark.parametrize(("raw", "why"), [
    ({"path": "/tmp/rank1.state"}, "it carries a filesystem path"),
    ({"host": "n5", "port": 7001, "token": "ab", "path": "/x"}, "it carries a filesystem path"),
    ({"host": "n5"}, r"it must be a wormhole end \{host, port, token\}, got \['host'\]"),
    ("n5:7001", "it must be a wormhole end .* got str"),
    ({"host": "", "port": 7001, "token": "ab"}, "its host must be"),
    ({"host": "n5", "port": 70000, "token": "ab"}, "its port must be 1-65535"),
    ({"host": "n5", "port": True, "token": "ab"}, "its port must be 1-65535"),
    ({"host": "n5", "port": 7001, "token": "not hex"}, "its token must be non-empty hex"),
    ({"host": "n5", "port": 7001, "token": ""}, "its token must be non-empty hex"),
])
def test_anything_else_is_refused_with_what_and_why(raw: object, why: str) -> None:
    with pytest.raises(ProtocolError, match=f"save's 'dest' is refused: {why}"):
        TransferAddress.parse(raw, "save's 'dest'")
