"""Fixtures for the security tests: a tiny model with its greedy reference, a throwaway PKI, tokens.

The PKI (a CA, a server certificate for 127.0.0.1/localhost, a client certificate) is generated at test
time with `cryptography`; no key material lives in the repository.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiny import prepare_tiny

from security.sec_helpers import N_TOKENS, PROMPT, TOKEN_A, TOKEN_B


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(shards dir, the 20 greedy tokens HF generate gives for PROMPT)."""
    model, shards = prepare_tiny(tmp_path_factory.mktemp("security"), "llama", 2, 2)
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return shards, expected[0, len(PROMPT) :].tolist()


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject_cn, issuer_key, issuer_name, key, *, ca=False, san=None, client=False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject_cn))
        .issuer_name(issuer_name or _name(subject_cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert, key) -> None:
    from cryptography.hazmat.primitives import serialization

    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """Paths: ca (CA cert), server_cert/server_key (for 127.0.0.1), client_cert/client_key, other_ca."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    out = tmp_path_factory.mktemp("pki")
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("ca", "server", "client", "other")}
    ca = _issue("splitinfer test CA", keys["ca"], None, keys["ca"], ca=True)
    other = _issue("some other CA", keys["other"], None, keys["other"], ca=True)
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = _issue("127.0.0.1", keys["ca"], ca.subject, keys["server"], san=san)
    client = _issue("client-1", keys["ca"], ca.subject, keys["client"], client=True)
    _write(out / "ca", ca, None)
    _write(out / "other_ca", other, None)
    _write(out / "server", server, keys["server"])
    _write(out / "client", client, keys["client"])
    return SimpleNamespace(
        ca=str(out / "ca.crt"), other_ca=str(out / "other_ca.crt"),
        server_cert=str(out / "server.crt"), server_key=str(out / "server.key"),
        client_cert=str(out / "client.crt"), client_key=str(out / "client.key"),
    )


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# two clients\n{TOKEN_A}\n\n{TOKEN_B}\n")
    return path
