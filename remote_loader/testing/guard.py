"""The keys that close the embedded server's internal services to anyone but itself: SeaweedFS
JWT signing keys for the filer's and volume server's HTTP ports, a CA and a certificate for
the gRPC ports and the master's HTTP port (mutual TLS), made fresh at each start (see
``server.py``)."""

from __future__ import annotations

import ipaddress
import secrets
from datetime import datetime, timedelta, timezone
from pathlib import Path

HOST = "127.0.0.1"
_TLS_COMPONENTS = ("MASTER", "VOLUME", "FILER", "S3", "ADMIN", "WORKER", "CLIENT")


def server_keys(directory: Path) -> dict[str, str]:
    """Fresh keys for SeaweedFS's internal services, as the environment variables ``weed``
    reads them from (``WEED_`` + a security.toml key): JWT signing keys for its HTTP ports
    and, for its gRPC ports, a CA and one certificate (server and client) signed by it,
    written into ``directory``. Nothing outside this server's processes holds them."""
    from cryptography import x509  # the ``server`` extra, imported by the one thing that needs it
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(mode=0o700, exist_ok=True)
    now = datetime.now(timezone.utc)

    def certificate(
        subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey, authority: bool
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True)
        )
        if not authority:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]), critical=False
            ).add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key, node_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = "remote-loader embedded S3 CA"
    ca = certificate(ca_name, ca_key, ca_name, ca_key, True)
    node = certificate("remote-loader embedded S3", node_key, ca_name, ca_key, False)
    files = {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "node.crt": node.public_bytes(serialization.Encoding.PEM),
        "node.key": node_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }
    for name, data in files.items():
        path = directory / name
        path.touch(mode=0o600)
        path.write_bytes(data)
    env = {
        f"WEED_JWT_{name}_KEY": secrets.token_hex(32)
        for name in ("SIGNING", "SIGNING_READ", "FILER_SIGNING", "FILER_SIGNING_READ")
    }
    env.update(
        WEED_ACCESS_UI="false",
        WEED_FILER_EXPOSE_DIRECTORY_METADATA_ENABLED="false",
        WEED_GRPC_CA=str(directory / "ca.crt"),
    )
    for component in _TLS_COMPONENTS:
        env[f"WEED_GRPC_{component}_CERT"] = str(directory / "node.crt")
        env[f"WEED_GRPC_{component}_KEY"] = str(directory / "node.key")
    # The master's HTTP port takes only HTTPS from a client holding a certificate of the
    # server's own CA: its admin calls (delete a bucket's collection, grow volumes) and its
    # status pages (buckets, counts, the data directory) answer no one else. Nothing of the
    # server's own calls it over HTTP, so the data path (S3 -> filer -> volume, plain HTTP with
    # JWT tokens) is untouched: HTTPS between filer and volume server doubled the server's CPU
    # per byte read (0.60 -> 1.14 s/GB of 8 MiB ranged GETs on loopback). The cost: the volume
    # server's /status and /healthz still answer anyone on the machine (see server.py).
    env["WEED_HTTPS_MASTER_CERT"] = str(directory / "node.crt")
    env["WEED_HTTPS_MASTER_KEY"] = str(directory / "node.key")
    env["WEED_HTTPS_MASTER_CA"] = str(directory / "ca.crt")
    return env
