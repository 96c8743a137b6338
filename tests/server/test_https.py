"""``pagellm serve`` over HTTPS with vLLM's flags: a certificate from a test CA (``trustme``) serves the API to a
client that trusts the CA (the ``openai`` SDK), the ready line says https, plain HTTP gets no API; mismatched or
missing files and half a pair stop the start before the model loads, naming the flags."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import trustme
from server_utils import ENGINE_FLAGS, ServerProcess


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": folder / "ca.pem", "key": folder / "key.pem", "cert": folder / "cert.pem",
             "other_key": folder / "other-key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(paths["other_key"]))
    return paths


def _tls12_cipher(port: int, ca: Path) -> str:
    """The cipher suite a TLS 1.2 client (offering OpenSSL's defaults) gets from the server."""
    context = ssl.create_default_context(cafile=str(ca))
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            return conn.cipher()[0]


def test_the_api_is_served_over_https(tiny_llama: Path, certs: dict[str, Path], tmp_path: Path) -> None:
    """With ``--ssl-ciphers`` (vLLM's) a TLS 1.2 client gets the one suite the server offers (its key is ECDSA), not
    the AES-GCM one OpenSSL would pick first."""
    server = ServerProcess(tiny_llama, ["--served-model-name", "tiny", "--ssl-keyfile", str(certs["key"]),
                                        "--ssl-certfile", str(certs["cert"]),
                                        "--ssl-ciphers", "ECDHE-ECDSA-CHACHA20-POLY1305"],
                           tmp_path / "server.log", certs["ca"])
    try:
        server.wait_healthy()
        assert f"at https://127.0.0.1:{server.port}/v1" in server.log()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(verify=server.verify))
        out = client.completions.create(model="tiny", prompt="a", max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        assert _tls12_cipher(server.port, certs["ca"]) == "ECDHE-ECDSA-CHACHA20-POLY1305"
        with pytest.raises(httpx.HTTPError):  # an HTTP client gets no answer from a TLS port
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--ssl-keyfile", "KEY"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "OTHER_KEY", "--ssl-certfile", "CERT"], "cannot use the TLS files"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "missing.pem"], "cannot use the TLS files"),
    (["--ssl-cert-reqs", "2"], "--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers go with --ssl-keyfile"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-ciphers", "NO-SUCH-SUITE"],
     "--ssl-ciphers 'NO-SUCH-SUITE': OpenSSL offers none of these cipher suites"),
])
def test_unusable_tls_flags_stop_the_start(tiny_llama: Path, certs: dict[str, Path], flags: list[str],
                                           message: str) -> None:
    named = {"KEY": certs["key"], "OTHER_KEY": certs["other_key"], "CERT": certs["cert"]}
    argv = [str(named.get(flag, flag)) for flag in flags]
    result = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", str(tiny_llama), "--port", "1", *argv,
                             *ENGINE_FLAGS], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
