"""Serving options (vLLM's flags): CORS (a browser's preflight, allowed and refused
origins, before authentication), HTTPS with a self-signed certificate made here,
--root-path behind a proxy's prefix, --disable-fastapi-docs. Each through the CLI's
parser and the functions `jaxserve serve` builds the app and uvicorn's config with."""
import argparse
import shutil
import subprocess

import httpx
import pytest

from server.app import CORSSettings, build_app
from server.cli_serve import add_serve_parser, ssl_settings
from tests.server.harness import RunningServer

ORIGIN = "http://app.example:3000"


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def cors_from(args) -> CORSSettings:
    return CORSSettings(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


@pytest.fixture
def app_server(tiny_async_llm):
    servers = []

    def start(*argv, **uvicorn_config):
        args = serve_args(*argv)
        app = build_app(tiny_async_llm, "tiny", api_key=args.api_key, cors=cors_from(args), root_path=args.root_path,
                        disable_fastapi_docs=args.disable_fastapi_docs)
        servers.append(RunningServer(app, **(ssl_settings(args) | uvicorn_config)))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_cors_preflight_and_origins(app_server):
    srv = app_server("--api-key", "k", "--allowed-origins", f'["{ORIGIN}"]', "--allow-credentials")
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{srv.url}/v1/chat/completions", headers=preflight)  # no key: a preflight carries none
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.options(f"{srv.url}/v1/chat/completions", headers=preflight | {"Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{srv.url}/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(f"{srv.url}/v1/models", headers={"Origin": ORIGIN})  # the key is still needed
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_cors_defaults_allow_any_origin(app_server):
    srv = app_server()
    r = httpx.options(f"{srv.url}/v1/completions",
                      headers={"Origin": "http://x.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_https_with_a_self_signed_certificate(app_server, tmp_path):
    openssl = shutil.which("openssl")
    assert openssl, "openssl makes the test's certificate"
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    srv = app_server("--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    assert srv.url.startswith("https://")
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 2},
                   verify=str(cert))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
        httpx.get(f"{srv.url}/v1/models")
    with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP is not served
        httpx.get(srv.url.replace("https", "http") + "/v1/models")


def test_root_path_and_disabled_docs(app_server):
    srv = app_server("--root-path", "/llm")
    # Behind a proxy that keeps the prefix, and one that strips it: both reach the route.
    assert httpx.get(f"{srv.url}/llm/v1/models").status_code == 200
    assert httpx.get(f"{srv.url}/v1/models").status_code == 200
    assert httpx.get(f"{srv.url}/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]
    bare = app_server("--disable-fastapi-docs")
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{bare.url}{path}").status_code == 404
    assert httpx.get(f"{bare.url}/v1/models").status_code == 200
