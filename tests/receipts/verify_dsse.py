"""A receipt checked by a standard DSSE verifier (securesystemslib's), not by executor-arm's own
code: `verify_dsse.py ENVELOPE.json PUBLIC_KEY.pem` exits 0 and prints the statement's
predicateType when a signature by the key verifies over DSSE's pre-authentication encoding and
the payload is an in-toto Statement v1; it exits 1 with the reason otherwise.

The key's keyid is executor-arm's: lowercase hex SHA-256 of the raw 32-byte Ed25519 public key.
"""

import hashlib
import json
import sys

from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey


def main() -> int:
    envelope_file, key_file = sys.argv[1], sys.argv[2]
    with open(key_file, "rb") as f:
        public = load_pem_public_key(f.read())
    keyid = hashlib.sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()
    key = SSlibKey.from_crypto(public, keyid=keyid)
    with open(envelope_file) as f:
        raw = json.load(f)
    try:
        envelope = Envelope.from_dict(raw)
        if envelope.payload_type != "application/vnd.in-toto+json":
            raise ValueError(f"payload type {envelope.payload_type!r}")
        envelope.verify([key], 1)
        statement = json.loads(envelope.payload)
        if statement.get("_type") != "https://in-toto.io/Statement/v1":
            raise ValueError(f"not an in-toto Statement v1: {statement.get('_type')!r}")
    except Exception as e:  # every failure is a refusal with its reason
        print(f"does not verify: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(statement["predicateType"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
