"""The HTTP doors' guard: the cluster's bearer token over TLS, health that follows the
engine (503 with a reason while no model is loaded), and an address in use refused."""

from __future__ import annotations

import socket
import ssl

import anthropic
import httpx
import openai
import pytest
from conftest import self_signed_cert, stop_cluster

from mlx_relay.api.http.server import HttpServer, ListenError
from mlx_relay.client.client import Client
from mlx_relay.launch.local import free_ports
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

TOKEN = "s3cret-token"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _trust(cert: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert)


@pytest.fixture(scope="module")
def secured(tiny_model, tmp_path_factory):
    from conftest import start_cluster

    model = tiny_model("llama", 3)
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"))
    port = free_ports(1)[0]
    running = start_cluster(
        model,
        1,
        tmp_path_factory.mktemp("logs"),
        "--http-address",
        str(port),  # a bare port: loopback
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        auth_token=TOKEN,
        tls_ca=str(cert),
    )
    yield running, f"https://127.0.0.1:{port}", str(cert), str(model)
    stop_cluster(running)


def test_token_required_over_tls(secured):
    _, base, cert, model = secured
    with httpx.Client(base_url=base, verify=_trust(cert), timeout=30) as http:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = http.post("/v1/chat/completions", json={"messages": MESSAGES}, headers=headers)
            assert r.status_code == 401
            assert "Bearer" in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "authentication_error"
        r = http.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # Open to probes and scrapers, which carry no token (issue 38); nothing else is.
        assert http.get("/metrics").status_code == 200
        assert http.get("/health").status_code == 200
        assert http.get("/v1/status").status_code == 401
        assert http.get("/v1/models").status_code == 401
    with pytest.raises(httpx.TransportError):  # plain HTTP to a TLS port
        httpx.get(base.replace("https", "http") + "/health", timeout=10)

    client = openai.OpenAI(
        base_url=base + "/v1",
        api_key=TOKEN,
        http_client=openai.DefaultHttpxClient(verify=_trust(cert)),
        max_retries=0,
    )
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
    assert reply.usage.completion_tokens <= 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=base + "/v1",
            api_key="nope",
            http_client=openai.DefaultHttpxClient(verify=_trust(cert)),
            max_retries=0,
        ).models.list()
    # Anthropic's SDK sends the key as x-api-key.
    claude = anthropic.Anthropic(
        base_url=base,
        api_key=TOKEN,
        http_client=anthropic.DefaultHttpxClient(verify=_trust(cert)),
        max_retries=0,
    )
    message = claude.messages.create(model=model, max_tokens=3, messages=MESSAGES)
    assert message.usage.output_tokens <= 3


def test_health_follows_the_engine(secured):
    running, base, cert, model = secured
    headers = {"authorization": f"Bearer {TOKEN}"}
    grpc_client = Client(running.address, token=TOKEN, tls_ca=cert, timeout=120)
    with (
        grpc_client,
        httpx.Client(base_url=base, verify=_trust(cert), timeout=60, headers=headers) as http,
    ):
        grpc_client.stub.Free(pb.FreeRequest(), timeout=60)
        r = http.get("/health")
        assert r.status_code == 503
        assert r.json()["state"] == "unloaded" and "no model is loaded" in r.json()["reason"]
        chat = http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert chat.status_code == 503 and "no model is loaded" in chat.json()["error"]["message"]
        assert http.get("/v1/models").json()["data"] == []
        grpc_client.stub.LoadModel(pb.LoadModelRequest(), timeout=120)
        assert http.get("/health").status_code == 200


def test_an_address_in_use_is_refused_at_once():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ListenError, match=f"cannot listen for HTTP on 127.0.0.1:{port}"):
            HttpServer(lambda *a: None, f"127.0.0.1:{port}")
    with pytest.raises(ListenError, match="not HOST:PORT"):
        HttpServer(lambda *a: None, "localhost:http")


def test_reachable_from_other_machines_without_a_token_warns(caplog, monkeypatch):
    import argparse
    import logging
    from types import SimpleNamespace

    from mlx_relay.api.http import server
    from mlx_relay.api.metrics import Metrics

    cluster = SimpleNamespace(metrics=Metrics(None))  # reached only per request

    monkeypatch.delenv("MLX_RELAY_AUTH_TOKEN", raising=False)
    args = argparse.Namespace(
        http_address=f"0.0.0.0:{free_ports(1)[0]}",
        auth_token=None,
        max_request_bytes=1 << 20,
        tls_cert="",
        tls_key="",
    )
    with caplog.at_level(logging.WARNING, logger="mlx_relay.http"):
        http = server.start(args, cluster=cluster)
    try:
        assert "reachable from other machines and needs no token" in caplog.text
        assert httpx.get(f"http://127.0.0.1:{http.port}/nowhere", timeout=10).status_code == 404
    finally:
        assert http.stop(grace=1).wait(5)
    assert not http.thread.is_alive()
    args.http_address = ""
    assert server.start(args, cluster=cluster) is None
