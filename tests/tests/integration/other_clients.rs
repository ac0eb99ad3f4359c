//! Other languages' gRPC clients on the agent's unix socket. Python's grpcio (C-core)
//! sends the socket's path as the HTTP/2 `:authority`, as grpc-java does and kubelet's
//! plugin watcher (grpc-go dialling a bare path); plain tonic refuses such a request
//! (PROTOCOL_ERROR). The agent answers them (shareguard-uds), and still refuses any other
//! authority h2 refuses. The clients come from `target/pyclients`, a venv that
//! scripts/test.sh makes (`ensure_py_clients` in scripts/lib.sh).

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{path::PathBuf, process::Command};

use shareguard_tests::{Agent, Options, generic_device};

/// The venv's Python, with grpcio and h2.
fn python() -> PathBuf {
    // target/<profile>/deps/<test exe> -> target/pyclients
    let exe = std::env::current_exe().unwrap();
    let target = exe.ancestors().nth(3).unwrap();
    let py = target.join("pyclients/bin/python");
    assert!(
        py.exists(),
        "{} not found: the Python gRPC clients are installed by scripts/test.sh (ensure_py_clients in scripts/lib.sh)",
        py.display()
    );
    py
}

fn run(script: &str, args: &[&str]) -> String {
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout.trim().to_owned()
}

/// grpcio on a default channel `unix://<socket>`: ListDevices (raw bytes, no generated
/// code) and the standard health check.
const GRPCIO: &str = r#"
import grpc, sys
ch = grpc.insecure_channel("unix://" + sys.argv[1])
def call(method, body):
    f = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        return "ok", f(body, timeout=10)
    except grpc.RpcError as e:
        return str(e.code()), (e.details() or "").encode()
st, body = call("/shareguard.v1.NodeAgent/ListDevices", b"")
print(st, b"gen-0" in body)
st, body = call("/grpc.health.v1.Health/Check", b"")
# HealthCheckResponse { status: SERVING (1) } is the two bytes 08 01.
print(st, body == b"\x08\x01")
"#;

/// A raw HTTP/2 client, the way kubelet's registration dial reaches a plugin: one gRPC
/// ListDevices with `:authority` set to argv[2]; prints the outcome.
const RAW_H2: &str = r#"
import socket, sys
import h2.config, h2.connection, h2.events
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
c = h2.connection.H2Connection(h2.config.H2Configuration(
    client_side=True, header_encoding=None, validate_outbound_headers=False,
    normalize_outbound_headers=False))
c.initiate_connection()
sid = c.get_next_available_stream_id()
c.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"),
    (b":path", b"/shareguard.v1.NodeAgent/ListDevices"), (b":authority", sys.argv[2].encode()),
    (b"content-type", b"application/grpc"), (b"te", b"trailers")])
c.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)
s.sendall(c.data_to_send())
body, status, outcome = b"", None, None
while outcome is None:
    data = s.recv(65536)
    if not data:
        outcome = "closed"
        break
    for ev in c.receive_data(data):
        if isinstance(ev, h2.events.DataReceived):
            body += ev.data
            c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            status = dict(ev.headers).get(b"grpc-status", status)
        elif isinstance(ev, h2.events.StreamEnded):
            outcome = "grpc-status " + (status or b"?").decode()
        elif isinstance(ev, h2.events.StreamReset):
            outcome = "reset " + str(int(ev.error_code))
    s.sendall(c.data_to_send())
print(outcome, b"gen-0" in body)
"#;

fn agent() -> Agent {
    Agent::start(Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &["team-a"],
        &[],
    )))
}

#[test]
fn grpcio_on_a_default_unix_channel_is_answered() {
    let a = agent();
    let out = run(GRPCIO, &[a.socket.to_str().unwrap()]);
    assert_eq!(out, "ok True\nok True", "grpcio's calls: {out}");
}

#[test]
fn a_socket_path_or_empty_authority_is_answered_and_nothing_else_loosened() {
    let a = agent();
    let sock = a.socket.to_str().unwrap().to_owned();
    // As C-core sends it: the path without its first slash, percent-encoded.
    let c_core = sock.trim_start_matches('/').replace('/', "%2F");
    for authority in [sock.as_str(), c_core.as_str(), "", "localhost"] {
        let out = run(RAW_H2, &[&sock, authority]);
        assert_eq!(out, "grpc-status 0 True", "authority {authority:?}: {out}");
    }
    // An authority h2 refuses for another reason is still refused: PROTOCOL_ERROR.
    let out = run(RAW_H2, &[&sock, "not a host!"]);
    assert_eq!(out, "reset 1 False", "{out}");
}
