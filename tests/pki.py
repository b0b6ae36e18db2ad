"""Test PKI: a CA and certificates made with openssl, for tests of the TLS transports.

``make_ca(d, "ca")`` writes ``ca.pem``/``ca.key`` in ``d``; ``make_cert(d, "alice", "ca", "alice")``
writes ``alice.pem``/``alice.key`` signed by it, with common name ``alice`` (and ``san``, e.g.
``"IP:127.0.0.1,DNS:localhost"`` for a server). ``tls_channel`` opens a client channel.
"""

from __future__ import annotations

import subprocess

import grpc


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["/usr/bin/openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=d)


def make_cert(d, name: str, ca: str, cn: str, san: str = "") -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.pem", "-extfile", str(ext), cwd=d)


def tls_channel(pki, port: int, client: str | None, ca: str = "ca") -> grpc.Channel:
    """A channel to 127.0.0.1:``port`` trusting ``ca``, with ``client``'s certificate (None: none)."""
    root = (pki / f"{ca}.pem").read_bytes()
    if client is None:
        creds = grpc.ssl_channel_credentials(root_certificates=root)
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=(pki / f"{client}.key").read_bytes(),
                                             certificate_chain=(pki / f"{client}.pem").read_bytes())
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)
