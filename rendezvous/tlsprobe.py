"""What failed in a TLS handshake with etcd, in words a user can act on.

gRPC reports every TLS failure alike (the channel is unavailable), so an etcd that
refuses this client's certificate, or whose certificate this client refuses, reads as an
unreachable etcd. When a TLS etcd accepts connections but does not answer, one handshake
with Python's ``ssl`` and the same files says which side refused what, and which
``--rdzv-conf`` key sets it.
"""

from __future__ import annotations

import socket
import ssl


def diagnose(
    host: str,
    port: int,
    ca: str | None,
    cert: str | None,
    key: str | None,
    timeout: float = 2.0,
) -> str | None:
    """Why a TLS connection to ``host:port`` with these files fails; None when the
    handshake succeeds (the problem lies elsewhere) or nothing can be said."""
    try:
        ctx = ssl.create_default_context(cafile=ca)
        if cert and key:
            ctx.load_cert_chain(cert, key)
        ctx.set_alpn_protocols(["h2"])
    except (OSError, ssl.SSLError) as e:
        return f"the TLS files cannot be loaded ({e}): check --rdzv-conf cacert=, cert=, key="
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    try:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.settimeout(min(timeout, 1.0))
            try:  # TLS 1.3: a refused client certificate arrives with the first read
                s.recv(1)
            except TimeoutError:
                return None
    except ssl.SSLCertVerificationError as e:
        what = e.verify_message or str(e)
        if "hostname" in what.lower() or "ip address mismatch" in what.lower():
            return (
                f"the TLS handshake failed: etcd's certificate does not name {host} ({what}); "
                "use a name its certificate has in --rdzv-endpoint"
            )
        return (
            f"the TLS handshake failed: this client refused etcd's certificate ({what}): it is "
            f"not signed by the CA in --rdzv-conf cacert={ca}"
        )
    except ssl.SSLError as e:
        reason = (e.reason or str(e)).upper()
        refused = ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN", "HANDSHAKE_FAILURE")
        if "CERTIFICATE_REQUIRED" in reason or (not cert and any(r in reason for r in refused)):
            return (
                "the TLS handshake failed: etcd requires a client certificate; give "
                "--rdzv-conf cert=<client certificate>,key=<its key>"
            )
        if any(r in reason for r in refused):
            return (
                f"the TLS handshake failed: etcd refused this client's certificate "
                f"(--rdzv-conf cert={cert}): it is not signed by a CA etcd trusts "
                "(its --trusted-ca-file)"
            )
        if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason:
            return "etcd there does not speak TLS: leave out cacert= and https://"
        return f"the TLS handshake failed: {e}"
    except OSError:
        return None
    return None
