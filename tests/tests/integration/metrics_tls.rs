//! `/metrics` over TLS with client certificates (`[agent] metrics_tls`): only a scraper
//! whose certificate the configured CA issued reads the metrics; one without a
//! certificate, with another CA's, or speaking plain HTTP gets nothing; a server
//! certificate renewed in place is used from the next connection on; health stays plain
//! HTTP on its own port for kubelet's probes. Certificates are made with `openssl`, the
//! scraper is `curl`, as an operator would check it by hand.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{fs, net::SocketAddr, path::Path, process::Command};

use shareguard_tests::{Agent, Options, generic_device, http_get};

fn openssl(dir: &Path, args: &[&str]) {
    let o = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl (Debian package openssl)");
    assert!(
        o.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A CA `name`.crt/.key in `dir`.
fn ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-subj",
            &format!("/CN={name}"),
            "-days",
            "2",
        ],
    );
}

/// A certificate `name`.crt/.key issued by CA `by`, for a server on 127.0.0.1 or for a
/// client.
fn issue(dir: &Path, name: &str, by: &str, server: bool) {
    let ext = dir.join(format!("{name}.ext"));
    fs::write(
        &ext,
        if server {
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
        } else {
            "extendedKeyUsage=clientAuth\n"
        },
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{by}.crt"),
            "-CAkey",
            &format!("{by}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-extfile",
            ext.to_str().unwrap(),
        ],
    );
}

/// `curl` on `/metrics` over TLS, trusting `server_ca`, with the client certificate
/// `client` if given: the body when the scrape succeeded.
fn scrape(dir: &Path, addr: SocketAddr, server_ca: &str, client: Option<&str>) -> Option<String> {
    let mut c = Command::new("curl");
    c.current_dir(dir)
        .args(["-sS", "--fail", "--max-time", "10", "--cacert"])
        .arg(format!("{server_ca}.crt"));
    if let Some(name) = client {
        c.arg("--cert")
            .arg(format!("{name}.crt"))
            .arg("--key")
            .arg(format!("{name}.key"));
    }
    let o = c
        .arg(format!("https://{addr}/metrics"))
        .output()
        .expect("curl");
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

#[test]
fn metrics_over_tls_need_a_client_certificate_of_the_ca() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    for name in ["server-ca", "client-ca", "other-ca", "server-ca-2"] {
        ca(d, name);
    }
    issue(d, "server", "server-ca", true);
    issue(d, "scraper", "client-ca", false);
    issue(d, "stranger", "other-ca", false);

    let mut o = Options::new(generic_device("gen-0", "10Gi", "1Gi", &["team-a"], &[]));
    o.agent_extra = format!(
        "health_addr = \"127.0.0.1:0\"\nmetrics_tls = {{ cert_file = {:?}, key_file = {:?}, client_ca_file = {:?} }}",
        d.join("server.crt"),
        d.join("server.key"),
        d.join("client-ca.crt")
    );
    let a = Agent::start(o);
    let metrics = a.metrics.unwrap();

    let body = scrape(d, metrics, "server-ca", Some("scraper")).expect("the scraper reads");
    assert!(body.contains("shareguard_device_capacity"), "{body}");
    assert_eq!(
        scrape(d, metrics, "server-ca", None),
        None,
        "no certificate"
    );
    assert_eq!(
        scrape(d, metrics, "server-ca", Some("stranger")),
        None,
        "another CA's certificate"
    );
    assert!(
        http_get(metrics, "/metrics").is_none_or(|(code, _)| code != 200),
        "plain HTTP on the TLS port"
    );

    // Renewed in place, by another CA: the next connection presents the new one.
    issue(d, "server-2", "server-ca-2", true);
    fs::copy(d.join("server-2.crt"), d.join("server.crt")).unwrap();
    fs::copy(d.join("server-2.key"), d.join("server.key")).unwrap();
    assert_eq!(
        scrape(d, metrics, "server-ca", Some("scraper")),
        None,
        "the old certificate is still served"
    );
    assert!(scrape(d, metrics, "server-ca-2", Some("scraper")).is_some());

    // A key that does not load refuses connections and says why; health is not TLS.
    fs::write(d.join("server.key"), "not a key").unwrap();
    assert_eq!(scrape(d, metrics, "server-ca-2", Some("scraper")), None);
    assert!(
        a.log_text().contains("metrics_tls cannot be loaded"),
        "{}",
        a.log_text()
    );
    let health = a
        .health_addr()
        .expect("the ready line names the health address");
    assert_eq!(http_get(health, "/readyz").unwrap().0, 200);
}
